"""One run: its context (context.py), its checkpoints (checkpointer.py), the checks of its config that need
the registries (checks.py)."""
