"""``python -m megarlhf ...``: the same command line as the ``megarlhf`` script (see megarlhf.cli)."""
import sys

from megarlhf.cli import main

# The guard matters: Megatron's checkpoint saver starts a multiprocessing Manager, whose child process
# re-imports the main module.
if __name__ == "__main__":
    sys.exit(main())
