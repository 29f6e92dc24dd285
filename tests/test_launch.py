"""The suite's launcher (tests/support/launch.py) leaves nothing behind (tests/README.md,
"Processes and temporary files"):

- a job's ranks may leave processes running when they end (a DataLoader worker waiting to
  flush a pipe no one reads, a child in a session of its own): the parent of forked ranks has
  ended them all before ``Ranks.run`` returns;
- a parent whose creator dies (a pytest worker killed, here while a child forked from it
  still holds the parent's input open, so only ``PR_SET_PDEATHSIG`` tells) or is interrupted
  (Ctrl-C: SIGINT to the foreground process group) in the middle of a job ends the job and
  itself;
- every process the suite starts keeps its temporary files in pytest's folder (TMPDIR and W&B's
  folders point there; conftest.py): a forked rank's and a fresh interpreter's.

The session's parent runs the first job (a fork, no new imports); the creators are small
interpreters whose parents import only ``torch.distributed`` (the job's store). conftest.py's
end of the run checks the same for the whole suite: any process still alive is killed and
fails the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support import launch
from conftest import WANDB_DIRS

# A rank that starts what a rank may leave behind: a forked child in its process group (a
# DataLoader worker) and ``sleep`` in a session of its own; writes "pid start" of itself and
# of both to PIDS.RANK, and TMPDIR, tempfile's folder and W&B's to PIDS.RANK.json; then
# exits, or with ``wait`` waits for its end.
LEAVING_RANK = textwrap.dedent("""
    import json, os, subprocess, sys, tempfile, time
    out, wait = sys.argv[1], sys.argv[2:] == ["wait"]
    rank = os.environ["RANK"]
    child = os.fork()
    if child == 0:
        while True:
            time.sleep(1000)
    sleeper = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    def start(pid):
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    pids = "".join(f"{pid} {start(pid)}\\n" for pid in (os.getpid(), child, sleeper.pid))
    places = {"tempfile": tempfile.gettempdir(),
              **{k: v for k, v in os.environ.items() if k == "TMPDIR" or k.startswith("WANDB")}}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(places, f)
    with open(f"{out}.{rank}.tmp", "w") as f:
        f.write(pids)
    os.rename(f"{out}.{rank}.tmp", f"{out}.{rank}")
    while wait:
        time.sleep(1000)
""")

# The creator of a parent: a test process in miniature. ``killed``: it forks a child that
# holds the parent's pipes open, as a pytest worker's forked children do.
CREATOR = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    from support.launch import Ranks
    script, out, logs, how = sys.argv[2:]
    ranks = Ranks(preload=("torch.distributed",), tokenizers=())
    if how == "killed" and os.fork() == 0:
        while True:
            time.sleep(1000)
    print(ranks.process.pid, flush=True)
    ranks.run(2, [script, out, "wait"], logs)
""")

# a margin for what ends at once: a process a signal ended, a parent's cleanup after it
ENDED_WITHIN_S = 120


def _start(pid: int) -> str | None:
    """The start time of a process that has not ended (None once it has: gone or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _alive(processes: list[tuple[int, str]]) -> list[str]:
    """Of ``(pid, start)`` pairs, those still running (the same start: not a reused pid),
    with their command lines."""
    return [f"{pid}: {launch.describe(pid)}" for pid, start in processes if _start(pid) == start]


def _read(out: Path, ranks: int) -> list[tuple[int, str]]:
    return [(int(pid), start) for rank in range(ranks)
            for pid, start in (line.split() for line in Path(f"{out}.{rank}").read_text()
                               .splitlines())]


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("launch") / "leaving_rank.py"
    path.write_text(LEAVING_RANK)
    return path


@pytest.fixture(scope="module")
def left_job(ranks, script, tmp_path_factory) -> tuple[Path, list[tuple[int, str]]]:
    """One rank of the session's parent that leaves two processes running and exits."""
    tmp = tmp_path_factory.mktemp("left-job")
    ranks.run(1, [script, tmp / "pids"], tmp / "logs").check()
    return tmp / "pids", _read(tmp / "pids", 1)


def test_what_a_job_leaves_has_ended_when_run_returns(left_job):
    out, processes = left_job
    assert len(processes) == 3
    assert _alive(processes) == []


def test_every_process_keeps_its_temporary_files_in_pytests_folder(left_job, tmp_path_factory):
    """TMPDIR and W&B's folders (conftest.py) in a forked rank and in a fresh interpreter are
    inside the run's pytest folder (the controller's, with xdist)."""
    out, _ = left_job
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    names = ["TMPDIR", *WANDB_DIRS]
    job = launch.python(["-c", "import json, os, sys, tempfile; places = {k: os.environ.get(k) "
                         "for k in sys.argv[1:]}; places['tempfile'] = tempfile.gettempdir(); "
                         "print(json.dumps(places))", *names]).check()
    for places in (json.loads(Path(f"{out}.0.json").read_text()), json.loads(job.stdout)):
        assert set(places) >= {"tempfile", "TMPDIR", *WANDB_DIRS}, places
        for name, place in places.items():
            assert Path(place).resolve().is_relative_to(root.resolve()), (name, place, root)


@pytest.mark.parametrize("how", ["killed", "interrupted"])
def test_a_parent_ends_its_job_and_itself_with_its_creator(script, tmp_path, how):
    """The creator starts a job of two ranks that wait forever; once they have started what
    they leave behind, the creator gets SIGKILL (``killed``) or its process group SIGINT
    (``interrupted``, Ctrl-C): the parent, the ranks and what they started all end."""
    out = tmp_path / "pids"
    creator = tmp_path / "creator.py"
    creator.write_text(CREATOR)
    command = [sys.executable, creator, launch.TESTS, script, out, tmp_path / "logs", how]
    with launch.session(command, cwd=launch.REPO, env={**os.environ, **launch.BASE_ENV},
                        stdout=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None
        parent = int(process.stdout.readline())
        processes = [(parent, _start(parent))]
        deadline = time.monotonic() + ENDED_WITHIN_S
        while not all(Path(f"{out}.{rank}").exists() for rank in range(2)):
            assert time.monotonic() < deadline and _start(parent), "the job did not start"
            time.sleep(0.1)
        processes += _read(out, 2)
        assert len(processes) == 7 and not [p for p in processes if p[1] is None]
        if how == "killed":
            os.kill(process.pid, signal.SIGKILL)
        else:
            os.killpg(process.pid, signal.SIGINT)
        deadline = time.monotonic() + ENDED_WITHIN_S
        while _alive(processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive(processes) == []
