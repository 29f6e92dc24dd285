"""Which run writes a ``checkpoint.dir``: one at a time.

Two runs given the same folder would each resume the other's latest checkpoint, delete the
step folder the other just wrote (a save first clears what an interrupted save left) and bless
a mix of both. So rank 0 of a run writes its claim into the folder at start-up (``OWNER``: its
host, process id and start time), and checks it is still its own before each save.

- At start-up (``claim``), a claim of a process that still runs a mimo training on this host
  is refused; another (a run that ended, crashed, or was requeued from another node) is taken
  over, the latter said: a process on another host cannot be asked whether it still runs.
- Before each save (``lost``), a claim that is no longer this process's stops the run without
  saving: the run that took the folder over keeps it.

Hand-written: neither megatron-core nor torch.distributed.checkpoint keeps a folder to one job.
"""

from __future__ import annotations

import json
import os
import socket
import time

from mimo_data.files import write_atomic
from mimo_train.errors import CheckpointError

OWNER = ".mimo-run"


def _this_process() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _read(root: str) -> dict | None:
    """The claim in ``root``, None where there is none (or it cannot be read: a claim cut
    short by a crash is no claim)."""
    try:
        with open(os.path.join(root, OWNER)) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and {"host", "pid"} <= set(found) else None


def _runs_mimo(pid: int) -> bool:
    """Whether process ``pid`` of this host lives and runs mimo's training (a process id
    reused by another program is not the run)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                 # another user's: it lives
        pass
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"mimo" in f.read()
    except OSError:                         # no /proc here: the process lives, say it runs
        return True


def _described(claim: dict) -> str:
    return (f"process {claim['pid']} on {claim['host']}" +
            (f", started {claim['started']}" if claim.get("started") else ""))


def claim(root: str) -> str | None:
    """Rank 0 at start-up: ``root`` claimed for this run; ``CheckpointError`` where a run on
    this host still writes it. Returns what to say where the claim of a run on another host
    was taken over, else None."""
    found = _read(root)
    me = _this_process()
    if found and found["host"] == me["host"] and found["pid"] != me["pid"] and \
            isinstance(found["pid"], int) and _runs_mimo(found["pid"]):
        raise CheckpointError(
            f"checkpoint.dir {root} is being written by another run ({_described(found)}): two "
            "runs in one checkpoint.dir resume, delete and mix each other's checkpoints; give "
            f"this run another checkpoint.dir (or stop that run; if it is no run, delete "
            f"{os.path.join(root, OWNER)})")
    write_atomic(os.path.join(root, OWNER), json.dumps(
        {**me, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode())
    if found and found["host"] != me["host"]:
        return (f"checkpoint.dir {root} was last claimed by {_described(found)}; this run takes "
                "it over (if that run still goes, it stops at its next save)")
    return None


def lost(root: str) -> str | None:
    """Rank 0 before a save: why this run no longer writes ``root`` (another run claimed it
    since), None while it does (a claim deleted meanwhile is written again)."""
    found = _read(root)
    me = _this_process()
    if found is None:
        write_atomic(os.path.join(root, OWNER), json.dumps(me).encode())
        return None
    if (found["host"], found["pid"]) == (me["host"], me["pid"]):
        return None
    return (f"checkpoint.dir {root} is now claimed by {_described(found)}: this run stops "
            "without saving, so that the two runs do not mix their checkpoints; give each run "
            "its own checkpoint.dir")
