"""``megarlhf COMMAND ... --nproc-per-node N``: N ranks on this machine, launched the way torchrun launches
them (torch's elastic agent, a standalone rendezvous), without torchrun's report.

torchrun answers any failed rank with its own ~40-line ``ChildFailedError`` traceback after the ranks'
messages. Here the agent runs in this process with its logging silenced, the ranks print their own
one-line errors (:mod:`megarlhf.core.console`: once per distinct message), and the exit status is the
failed ranks' (1 for an error in what the user gave). Ranks killed by a signal with none having exited
with an error (the OOM killer, a SIGKILL) are named in one line. The agent's per-run directory (torch makes a
``torchelastic_*`` one in the temporary directory and leaves it behind) is removed when the launch ends.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
from typing import Sequence


def _silence_the_agent() -> None:
    """torch's elastic loggers each set their own level (``LOGLEVEL``), so each is raised to CRITICAL."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch_local(argv: Sequence[str], nproc: int) -> int:
    """Runs ``python -m megarlhf argv`` on ``nproc`` local ranks; returns the exit status."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets, without its banner about it
    _silence_the_agent()
    try:
        with tempfile.TemporaryDirectory(prefix="megarlhf-launch-") as agent_dir:
            torchrun.run(torchrun.parse_args(["--standalone", "--nproc-per-node", str(nproc), "--log-dir", agent_dir,
                                              "--no-python", sys.executable, "-m", "megarlhf", *argv]))
    except ChildFailedError as err:
        worst = max(failure.exitcode for failure in err.failures.values())
        if worst > 0:  # the ranks said why; the agent then stopped the others (SIGTERM): not news
            return worst
        signalled = [f"rank {rank} ({failure.signal_name()})" for rank, failure in sorted(err.failures.items())]
        print(f"megarlhf: {', '.join(signalled)} killed by a signal", file=sys.stderr, flush=True)
        return 1
    return 0
