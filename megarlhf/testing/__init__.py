"""Helpers for megarlhf's own tests and benchmarks (multi-rank launching); not used at run time."""
