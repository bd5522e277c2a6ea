"""Process groups and Megatron parallel state from config, the CPU compatibility layer for Megatron-Core,
context-parallel attention, and shared-prefix (tree) packed rows."""

from parallel import cpu_compat as _cpu_compat

# before anything imports Megatron (every module that does imports this package first): see patch 8 there
_cpu_compat.install_import_patches()
