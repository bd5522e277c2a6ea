"""Process groups and Megatron parallel state from config, the CPU compatibility layer for Megatron-Core,
and context-parallel attention."""
