"""Process groups and Megatron parallel state from config, the CPU compatibility layer for Megatron-Core,
context-parallel attention, and shared-prefix (tree) packed rows."""
