"""Process groups and Megatron parallel state from config, the CPU compatibility layer for Megatron-Core,
context-parallel attention, and shared-prefix (tree) packed rows."""

from parallel import cpu_compat as _cpu_compat, megatron_import as _megatron_import

# before Megatron is imported (megarlhf's Megatron users import this package first: model_providers through its
# base, the rest after parallel.runtime started the process): see patch 8 there. Only a speed-up: a process that
# imports Megatron first keeps Megatron's compiled fusions, unused on CPU.
_cpu_compat.install_import_patches()
# and on every device: Megatron's timers load without wandb (parallel.megatron_import)
_megatron_import.install()
