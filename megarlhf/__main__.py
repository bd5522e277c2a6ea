"""``python -m megarlhf ...`` and the ``megarlhf`` script: the command line of megarlhf.cli, quiet unless
``--verbose`` (megarlhf.core.quiet: the environment is set before torch is imported). Once the command has
returned, the process ends without the interpreter's teardown (megarlhf.core.process_exit)."""
import sys

from megarlhf.core.process_exit import exit_process
from megarlhf.core.quiet import quiet_environment, route_logs


def command() -> int:
    verbose = "--verbose" in sys.argv[1:]
    if not verbose:
        quiet_environment()
    from megarlhf.cli import main

    if not verbose:
        route_logs()
    return main()


def run() -> None:
    exit_process(command())


# The guard matters: Megatron's checkpoint saver starts a multiprocessing Manager, whose child process
# re-imports the main module.
if __name__ == "__main__":
    run()
