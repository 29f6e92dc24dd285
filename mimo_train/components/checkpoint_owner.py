"""Which run writes a ``checkpoint.dir``: one at a time.

Two runs given the same folder would each resume the other's latest checkpoint, delete the
step folder the other just wrote (a save first clears what an interrupted save left) and bless
a mix of both. So rank 0 of a run writes its claim into the folder at start-up (``OWNER``: its
host, process, start time and job), refreshes it while it trains (``refresh``), checks it
is still its own before each save and before it moves ``latest`` (``lost``), and removes it
when the run ends (``release``).

At start-up (``claim``) a claim is taken over where its run has ended: on this host (and
process-id namespace), its process (the same process id and start time since the same boot)
is gone, or the claim was written in another folder (a live run's folder copied: its claim
holds the folder's device and inode, which the copy's are not); on another host, which
cannot be asked, its claim was not refreshed for ``STALE_S``. A claim of the same job
(Slurm's job id, torchrun's run id: a requeue, an elastic restart) made on another host is
taken over at once; on this host, only once its process is gone, as any other's (two job
steps of one allocation, say, would mix their checkpoints as two jobs would); a plain
``torchrun`` (no ``--rdzv-id``) names no job: its run id is "none" in every launch.
Otherwise the run is refused, naming the run that holds the folder.

Hand-written: neither megatron-core nor torch.distributed.checkpoint keeps a folder to one job.
"""

from __future__ import annotations

import json
import os
import socket
import time

from mimo_data.files import write_atomic
from mimo_train.errors import CheckpointError
from mimo_train.runtime.console import PREFIX, say
from mimo_train.runtime.launcher import start_ticks

OWNER = ".mimo-run"
REFRESH_S = 60.0             # how often a training run rewrites its claim
STALE_S = 600.0              # a claim of another host not rewritten for this long: its run ended
_JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
# values that name no job: torchrun's run id when no --rdzv-id is given (every plain launch)
_NO_JOB = {"TORCHELASTIC_RUN_ID": "none"}
_refreshed = 0.0             # when this process last wrote its claim (time.time())


def _proc(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _process(pid: int) -> dict:
    """What tells process ``pid`` of this host from a later one given its number: the boot
    it runs in and its start time (clock ticks since boot; Linux's /proc, else None)."""
    boot = _proc("/proc/sys/kernel/random/boot_id")
    return {"boot": boot.strip() if boot else None, "start": start_ticks(pid)}


def _this_run() -> dict:
    job = next((f"{name}={os.environ[name]}" for name in _JOB_VARIABLES
                if os.environ.get(name) not in (None, "", _NO_JOB.get(name))), None)
    try:        # containers of one host name (pods on the host's network) number apart
        namespace: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return {"host": socket.gethostname(), "pid": os.getpid(), **_process(os.getpid()),
            "pid_namespace": namespace, "job": job,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _read(root: str) -> dict | None:
    """The claim in ``root``, None where there is none (or it cannot be read: a claim cut
    short by a crash is no claim)."""
    try:
        with open(os.path.join(root, OWNER)) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and {"host", "pid"} <= set(found) else None


def _folder(root: str) -> list[int] | None:
    """The folder ``root``'s device and inode (another folder's, a copy's, differ on this
    host); None where it is not there."""
    try:
        stat = os.stat(root)
    except OSError:
        return None
    return [stat.st_dev, stat.st_ino]


def _write(root: str, claim: dict) -> None:
    global _refreshed
    os.makedirs(root, exist_ok=True)        # (a folder deleted meanwhile is made again)
    write_atomic(os.path.join(root, OWNER), json.dumps({**claim, "folder": _folder(root)})
                 .encode())
    _refreshed = time.time()


def _ours(found: dict, me: dict) -> bool:
    return (found.get("host"), found.get("pid"), found.get("start")) == \
        (me["host"], me["pid"], me["start"])


def _same_host(found: dict, me: dict) -> bool:
    """Whether the claim ``found`` was written on this host, in this process-id namespace (a
    claim an earlier mimo wrote names none: its host's, as that mimo read it)."""
    return (found.get("host"), found.get("pid_namespace", me["pid_namespace"])) == \
        (me["host"], me["pid_namespace"])


def _still_runs(found: dict, me: dict, root: str) -> bool:
    """Whether the run that wrote ``found`` may still write ``root``: another host's (or
    another process-id namespace's, whose processes this one cannot look up) until its claim
    is stale, this host's while its process runs."""
    if not _same_host(found, me):
        if found.get("job") and found.get("job") == me["job"]:
            return False                    # this job, requeued or restarted elsewhere
        try:
            age = time.time() - os.path.getmtime(os.path.join(root, OWNER))
        except OSError:
            return False
        return age < STALE_S
    pid = found.get("pid")
    if not isinstance(pid, int) or pid == me["pid"]:
        return False
    if found.get("folder") not in (None, _folder(root)):
        return False                        # written in another folder: a copy's claim
    now = _process(pid)
    if now["start"] is None:                # gone, or no /proc to ask
        return False
    return (found.get("boot"), found.get("start")) == (now["boot"], now["start"])


def _described(claim: dict) -> str:
    return (f"process {claim['pid']} on {claim['host']}" +
            (f" ({claim['job']})" if claim.get("job") else "") +
            (f", started {claim['started']}" if claim.get("started") else ""))


def check(root: str) -> None:
    """``CheckpointError`` where the run that claimed ``root`` still runs (nothing written:
    what every rank asks before it says anything else of the folder)."""
    found = _read(root)
    me = _this_run()
    if found and _still_runs(found, me, root):
        other_host = not _same_host(found, me)
        restarted = me["job"] is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        raise CheckpointError(
            f"checkpoint.dir {root} is being written by another run ({_described(found)}"
            + (f"; its claim was renewed less than {STALE_S / 60:.0f} minutes ago" if
               other_host else "") + "): two runs in one checkpoint.dir resume, delete and "
            "mix each other's checkpoints; give this run another checkpoint.dir (or stop that "
            f"run; if it is no run, delete {os.path.join(root, OWNER)})"
            + ("; if it is this job before torchrun restarted it, give torchrun --rdzv-id (an "
               "id of the job): a restart of the same job takes its folder over at once"
               if restarted and other_host else ""))


def writer(root: str) -> str | None:
    """The run that writes ``root`` now, described; None where none does (what a check of
    its checkpoints from outside the run says beside a step it may be saving)."""
    found = _read(root)
    return _described(found) if found and _still_runs(found, _this_run(), root) else None


def claim(root: str) -> None:
    """Rank 0 at start-up: ``root`` claimed for this run; ``CheckpointError`` where the run
    that claimed it still runs, or where the claim cannot be written (a full disk)."""
    check(root)
    try:
        _write(root, _this_run())
    except OSError as error:
        raise CheckpointError(f"checkpoint.dir {root}: the run's claim {OWNER} cannot be "
                              f"written there ({error.strerror or error}): free space there "
                              "(an incomplete step folder, one without integrity.json, may "
                              "go) or give another checkpoint.dir") from None


def refresh(root: str) -> None:
    """Rank 0 while training: the claim rewritten every ``REFRESH_S`` (what tells a run of
    another host that this one still goes)."""
    global _refreshed
    if time.time() - _refreshed >= REFRESH_S:
        found = _read(root)
        if found is not None and _ours(found, _this_run()):
            try:
                _write(root, found)
            except OSError as error:    # training goes on; the next save says what it meets
                _refreshed = time.time()
                say(f"{PREFIX}warning: the run's claim {os.path.join(root, OWNER)} was not "
                    f"renewed ({error.strerror or error})")


def release(root: str) -> None:
    """Rank 0 once the run has ended, its saves complete: its claim removed (a run of another
    host may take the folder at once; a crashed run's claim stays until it is stale)."""
    found = _read(root)
    if found is not None and _ours(found, _this_run()):
        os.remove(os.path.join(root, OWNER))


def lost(root: str) -> str | None:
    """Rank 0 before a save and before it moves ``latest``: why this run no longer writes
    ``root`` (another run claimed it since), None while it does (a claim deleted meanwhile is
    written again)."""
    found = _read(root)
    me = _this_run()
    if found is None:
        _write(root, me)
        return None
    if _ours(found, me):
        return None
    return (f"checkpoint.dir {root} is now claimed by {_described(found)}: this run stops "
            "without saving, so that the two runs do not mix their checkpoints; give each run "
            "its own checkpoint.dir")
