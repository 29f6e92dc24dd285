"""What the launcher (torchrun, Slurm's srun) says of this process, read from the environment
alone: no torch import, so a refusal comes before the seconds it takes."""

from __future__ import annotations

import os
import time


def unjoined_tasks() -> str | None:
    """Why this process cannot train although it runs: ``srun`` started several tasks of it
    (``SLURM_STEP_NUM_TASKS``, which an allocation's shell, ``salloc``'s, lacks) and no
    torchrun made them ranks of one job, so each would train a run of its own; None where it
    is a rank (``RANK``) or alone."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
    if "RANK" in os.environ or not tasks.isdigit() or int(tasks) <= 1:
        return None
    return (f"srun started {tasks} tasks of this command (SLURM_STEP_NUM_TASKS={tasks}) and no "
            "torchrun joined them into one job: each would train a run of its own (given one "
            "checkpoint.dir, taking each other's checkpoints over). Start one torchrun a node "
            "under srun: srun --ntasks-per-node=1 torchrun --nnodes $SLURM_NNODES "
            "--nproc-per-node GPUS --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id "
            "$SLURM_JOB_ID -m mimo_train ... (docs/long-runs.md); for runs of their own, one a "
            "task, on purpose, unset SLURM_STEP_NUM_TASKS")


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux's ``/proc``); None where
    it cannot be read (gone, or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # the fields after the command's name, ")": state is field 3, starttime field 22
            return int(stat.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def started() -> float:
    """The ``time.monotonic()`` at which this process started (``start_ticks``; now where it
    cannot be read): what ``train.exit_duration_minutes`` counts from, the imports and launch
    before any of mimo's code ran included."""
    ticks = start_ticks(os.getpid())
    try:
        with open("/proc/uptime") as uptime:
            now = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        ticks = None
    age = 0.0 if ticks is None else max(0.0, now - ticks / os.sysconf("SC_CLK_TCK"))
    return time.monotonic() - age
