"""A single-node Slurm on this machine, for testing the sbatch scripts (needs root and apt-get).

:func:`ensure_local_slurm` installs Debian's slurmctld / slurmd / slurm-client / munge if sbatch is
missing, starts munged, writes a minimal slurm.conf whose node line is ``slurmd -C``'s (no GPUs, one
partition), starts slurmctld and slurmd unless they run already, and waits until the node is idle.
No systemd: the daemons are started by hand (docs/PLATFORM.md, "Slurm on a single CPU machine").
:func:`slurm_unavailable` says why it cannot be done here (None when it can).

Run as a script to set the cluster up by hand: ``python tests/launch/_local_slurm.py``.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

CONF = Path("/etc/slurm/slurm.conf")
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]


class SlurmInstallError(RuntimeError):
    """apt-get could not install Slurm (no package mirror reachable, ...): the tests skip."""


def slurm_unavailable() -> str | None:
    if shutil.which("sbatch") and shutil.which("slurmctld"):
        return None if os.geteuid() == 0 or _node_idle() else "Slurm is installed but not running (and not root)"
    if os.geteuid() != 0:
        return "not root: cannot install Slurm"
    if not shutil.which("apt-get"):
        return "no apt-get: cannot install Slurm"
    return None


def _run(cmd: list[str], timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check)


def _running(name: str) -> bool:
    return _run(["pgrep", "-x", name], check=False).returncode == 0


def _node_idle() -> bool:
    if not shutil.which("sinfo"):
        return False
    out = _run(["sinfo", "-h", "-o", "%t"], check=False, timeout=20).stdout.split()
    return "idle" in out or "mix" in out


def _install() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, timeout=600, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES], check=True,
                       capture_output=True, timeout=900, env=env)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise SlurmInstallError(f"apt-get could not install {' '.join(PACKAGES)}: "
                                f"{getattr(exc, 'stderr', '') or exc}") from None


def _write_conf() -> None:
    host = socket.gethostname()
    node = next(line for line in _run(["slurmd", "-C"]).stdout.splitlines() if line.startswith("NodeName"))
    CONF.parent.mkdir(parents=True, exist_ok=True)
    CONF.write_text("\n".join([
        "ClusterName=local", f"SlurmctldHost={host}", "AuthType=auth/munge", "SlurmUser=root",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none", "ReturnToService=2", "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid", "StateSaveLocation=/var/spool/slurmctld",
        "SlurmdSpoolDir=/var/spool/slurmd", "SlurmctldLogFile=/var/log/slurm/slurmctld.log",
        "SlurmdLogFile=/var/log/slurm/slurmd.log", node.split(" UpTime")[0],
        f"PartitionName=local Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""]))


def ensure_local_slurm(timeout_s: float = 120) -> None:
    """Installs (if needed) and starts a one-node Slurm; returns once the node accepts jobs."""
    if _node_idle():
        return
    if not shutil.which("sbatch") or not shutil.which("slurmctld"):
        _install()
    for directory in ("/var/spool/slurmd", "/var/spool/slurmctld", "/var/log/slurm"):
        os.makedirs(directory, exist_ok=True)
    if not _running("munged"):
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        _run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"])
    if not CONF.exists() or "ClusterName=local" not in CONF.read_text():
        _write_conf()
    if not _running("slurmctld"):
        _run(["slurmctld"])
    if not _running("slurmd"):
        _run(["slurmd"])
    deadline = time.monotonic() + timeout_s
    while not _node_idle():
        if time.monotonic() > deadline:
            raise RuntimeError(f"local Slurm: the node is not idle after {timeout_s} s:\n"
                               + _run(["sinfo"], check=False).stdout)
        time.sleep(2)


if __name__ == "__main__":
    reason = slurm_unavailable()
    if reason:
        raise SystemExit(f"cannot set up Slurm here: {reason}")
    ensure_local_slurm()
    print(_run(["sinfo"]).stdout)
