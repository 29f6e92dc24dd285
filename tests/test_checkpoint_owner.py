"""One run at a time writes a checkpoint.dir (``mimo_train.components.checkpoint_owner``): a
second run of this host is refused at start-up while the first runs, a claim left by a run
that ended (or by a run of another host) is taken over, and a run whose claim another took
stops before it saves. The digest side (a data file deleted while it was saved fails the
save) is in tests/test_digests.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from mimo_train.components import checkpoint_owner
from mimo_train.components.checkpoint_owner import OWNER
from mimo_train.errors import CheckpointError


def _claimed_by(root, host: str, pid: int) -> None:
    (root / OWNER).write_text(json.dumps({"host": host, "pid": pid, "started": "earlier"}))


@pytest.fixture
def other_run():
    """A live process of this host whose command line names mimo, as a training's does."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                "-m", "mimo_train"])
    yield process
    process.kill()
    process.wait()


def test_a_run_of_this_host_that_still_goes_keeps_its_folder(tmp_path, other_run):
    host = socket.gethostname()
    _claimed_by(tmp_path, host, other_run.pid)
    with pytest.raises(CheckpointError, match=rf"checkpoint.dir {tmp_path} is being written by "
                       rf"another run \(process {other_run.pid} on {host}, started earlier\)"
                       ) as refused:
        checkpoint_owner.claim(str(tmp_path))
    assert refused.value.exit_code == 2
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == other_run.pid   # left as is
    other_run.kill()
    other_run.wait()                       # it ended (crashed, say): its claim is taken over
    assert checkpoint_owner.claim(str(tmp_path)) is None
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()


def test_a_process_id_reused_by_another_program_is_no_run(tmp_path):
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as process:
        _claimed_by(tmp_path, socket.gethostname(), process.pid)
        try:
            assert checkpoint_owner.claim(str(tmp_path)) is None
        finally:
            process.kill()


def test_another_hosts_claim_is_taken_over_and_said(tmp_path):
    _claimed_by(tmp_path, "node-17", 4242)
    said = checkpoint_owner.claim(str(tmp_path))
    assert said == (f"checkpoint.dir {tmp_path} was last claimed by process 4242 on node-17, "
                    "started earlier; this run takes it over (if that run still goes, it stops "
                    "at its next save)")
    assert checkpoint_owner.lost(str(tmp_path)) is None


def test_a_run_whose_claim_was_taken_stops_before_it_saves(tmp_path):
    assert checkpoint_owner.claim(str(tmp_path)) is None
    assert checkpoint_owner.lost(str(tmp_path)) is None
    _claimed_by(tmp_path, "node-3", 77)                   # a second run took the folder over
    assert checkpoint_owner.lost(str(tmp_path)) == (
        f"checkpoint.dir {tmp_path} is now claimed by process 77 on node-3, started earlier: "
        "this run stops without saving, so that the two runs do not mix their checkpoints; "
        "give each run its own checkpoint.dir")
    (tmp_path / OWNER).unlink()                           # deleted: claimed again, goes on
    assert checkpoint_owner.lost(str(tmp_path)) is None
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()
