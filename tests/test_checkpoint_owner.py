"""One run at a time writes a checkpoint.dir (``mimo_train.components.checkpoint_owner``): a
second run is refused at start-up while the first runs (on this host: its very process, by
boot and start time; on another: its claim renewed recently), a claim of a run that ended or
of the same job is taken over, and a run whose claim another took stops before it saves. The
digest side (a data file deleted while it was saved fails the save) is in
tests/test_digests.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

from mimo_train.components import checkpoint_owner
from mimo_train.components.checkpoint_owner import OWNER
from mimo_train.errors import CheckpointError


def _claim_of(root, **fields) -> dict:
    claim = {"host": socket.gethostname(), "pid": 1, "boot": None, "start": None, "job": None,
             "pid_namespace": checkpoint_owner._this_run()["pid_namespace"],
             "started": "earlier", **fields}
    (root / OWNER).write_text(json.dumps(claim))
    return claim


@pytest.fixture
def other_run():
    """A live process of this host, and its claim's identity (boot and start time)."""
    process = subprocess.Popen(["sleep", "60"])
    yield process, checkpoint_owner._process(process.pid)
    process.kill()
    process.wait()


@pytest.fixture(autouse=True)
def no_job(monkeypatch):
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def test_a_run_of_this_host_that_still_goes_keeps_its_folder(tmp_path, other_run):
    process, identity = other_run
    assert identity["start"] is not None and identity["boot"]
    _claim_of(tmp_path, pid=process.pid, **identity)
    with pytest.raises(CheckpointError, match=rf"checkpoint.dir {tmp_path} is being written by "
                       rf"another run \(process {process.pid} on {socket.gethostname()}, "
                       r"started earlier\)") as refused:
        checkpoint_owner.claim(str(tmp_path))
    assert refused.value.exit_code == 2
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == process.pid   # left as is
    process.kill()
    process.wait()                         # it ended (crashed, say): its claim is taken over
    checkpoint_owner.claim(str(tmp_path))
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()


def test_a_copy_of_a_live_runs_folder_is_no_run_of_its_own(tmp_path, other_run):
    """``cp -r`` of a folder a run of this host still writes: the copy's claim was written in
    the original folder (its device and inode), so a run in the copy takes it over; the
    original stays the live run's."""
    import shutil
    process, identity = other_run
    (tmp_path / "run").mkdir()
    _claim_of(tmp_path / "run", pid=process.pid, **identity,
              folder=checkpoint_owner._folder(str(tmp_path / "run")))
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    checkpoint_owner.claim(str(tmp_path / "copy"))
    assert json.loads((tmp_path / "copy" / OWNER).read_text())["pid"] == os.getpid()
    with pytest.raises(CheckpointError, match="is being written by another run"):
        checkpoint_owner.claim(str(tmp_path / "run"))


def test_a_process_id_given_to_another_process_is_no_run(tmp_path, other_run):
    """The claim's process id now names a process started later (a restarted container's)."""
    process, identity = other_run
    _claim_of(tmp_path, pid=process.pid, boot=identity["boot"], start=identity["start"] - 1)
    checkpoint_owner.claim(str(tmp_path))
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()


def test_another_hosts_claim_holds_while_it_is_renewed(tmp_path):
    _claim_of(tmp_path, host="node-17", pid=4242)
    with pytest.raises(CheckpointError, match=r"another run \(process 4242 on node-17, started "
                       r"earlier; its claim was renewed less than 10 minutes ago\)"):
        checkpoint_owner.claim(str(tmp_path))
    old = time.time() - checkpoint_owner.STALE_S - 1
    os.utime(tmp_path / OWNER, (old, old))           # that run stopped renewing it: ended
    checkpoint_owner.claim(str(tmp_path))
    assert json.loads((tmp_path / OWNER).read_text())["host"] == socket.gethostname()


def test_a_claim_of_this_host_name_in_another_pid_namespace_holds_while_renewed(tmp_path):
    """Another container of this host's name (a pod on the host's network): its process ids
    are not this one's to look up, so its run is another host's, not one that has ended."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    _claim_of(tmp_path, pid=ended.pid, pid_namespace="pid:[1]")
    with pytest.raises(CheckpointError, match="its claim was renewed less than 10 minutes ago"):
        checkpoint_owner.claim(str(tmp_path))
    old = time.time() - checkpoint_owner.STALE_S - 1
    os.utime(tmp_path / OWNER, (old, old))
    checkpoint_owner.claim(str(tmp_path))
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()
    # a claim an earlier mimo wrote names no namespace: its host's, as that mimo read it (a
    # run that crashed before an upgrade is taken over at once, not after STALE_S)
    claim = _claim_of(tmp_path, pid=ended.pid)
    del claim["pid_namespace"]
    (tmp_path / OWNER).write_text(json.dumps(claim))
    checkpoint_owner.claim(str(tmp_path))
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()


def test_the_same_job_takes_its_claim_over_anywhere(tmp_path, monkeypatch):
    """A job requeued onto another node, at once: Slurm keeps its job id."""
    _claim_of(tmp_path, host="node-17", pid=4242, job="SLURM_JOB_ID=981")
    monkeypatch.setenv("SLURM_JOB_ID", "981")
    checkpoint_owner.claim(str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "982")                      # another job: refused
    _claim_of(tmp_path, host="node-17", pid=4242, job="SLURM_JOB_ID=981")
    with pytest.raises(CheckpointError, match=r"\(process 4242 on node-17 \(SLURM_JOB_ID=981\)"):
        checkpoint_owner.claim(str(tmp_path))


def test_the_same_jobs_live_run_of_this_host_keeps_its_folder(tmp_path, monkeypatch,
                                                              other_run):
    """Two job steps of one Slurm allocation (one job id) given one folder: the second is
    refused while the first's process runs (it took the folder over, loaded the first's
    checkpoint and left it to stop without saving), and takes it over once it is gone (a
    restart of the job on this host)."""
    process, identity = other_run
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _claim_of(tmp_path, pid=process.pid, job="SLURM_JOB_ID=4242", **identity)
    with pytest.raises(CheckpointError, match=rf"another run \(process {process.pid} on "
                       rf"{socket.gethostname()} \(SLURM_JOB_ID=4242\)"):
        checkpoint_owner.claim(str(tmp_path))
    process.kill()
    process.wait()
    checkpoint_owner.claim(str(tmp_path))
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()


def test_a_plain_torchrun_names_no_job(tmp_path, monkeypatch, other_run):
    """torchrun without --rdzv-id sets the run id "none" in every launch: a second launch
    beside a running one is refused like any other run, not taken for a restart of it."""
    process, identity = other_run
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    _claim_of(tmp_path, pid=process.pid, job="TORCHELASTIC_RUN_ID=none", **identity)
    with pytest.raises(CheckpointError, match="is being written by another run"):
        checkpoint_owner.claim(str(tmp_path))
    process.kill()
    process.wait()
    checkpoint_owner.claim(str(tmp_path))
    assert json.loads((tmp_path / OWNER).read_text())["job"] is None


def test_a_live_runs_folder_is_said_before_anything_of_its_checkpoints(tmp_path, other_run):
    """checkpoint.resume=false beside a run that still writes the folder: the run is named,
    not its checkpoints called an earlier run's (with a command that would delete them)."""
    from mimo_train.components.checkpoint import prepare

    process, identity = other_run
    (tmp_path / "step_0000002").mkdir()
    (tmp_path / "step_0000002" / "integrity.json").write_text("{}")
    _claim_of(tmp_path, pid=process.pid, **identity)
    for resume in (False, True):
        with pytest.raises(CheckpointError, match="is being written by another run"):
            prepare(str(tmp_path), resume=resume)
    process.kill()
    process.wait()
    with pytest.raises(CheckpointError, match="holds an earlier run's checkpoints"):
        prepare(str(tmp_path), resume=False)


def test_mimo_inspect_names_the_run_writing_the_folder(tmp_path, other_run, capsys):
    """A step being saved by a live run reads INCOMPLETE: the report says which run writes
    the folder now, and says nothing of one that ended."""
    from mimo_train.inspect_cli import main

    process, identity = other_run
    (tmp_path / "step_0000004").mkdir()                 # its save under way: no manifest yet
    (tmp_path / "step_0000004" / ".metadata").write_bytes(b"")
    _claim_of(tmp_path, pid=process.pid, **identity)
    assert main(["checkpoint", str(tmp_path), "--all"]) == 1
    out = capsys.readouterr().out
    assert f"\na run writes {tmp_path} now (process {process.pid} on {socket.gethostname()}, " \
        "started earlier): a step it is saving reads INCOMPLETE until its save finishes" in out
    assert "step_0000004: INCOMPLETE" in out, out
    process.kill()
    process.wait()
    main(["checkpoint", str(tmp_path), "--all"])
    assert "a run writes" not in capsys.readouterr().out


def test_a_run_renews_its_claim_and_stops_before_it_saves_once_it_is_taken(tmp_path,
                                                                           monkeypatch):
    checkpoint_owner.claim(str(tmp_path))
    assert checkpoint_owner.lost(str(tmp_path)) is None
    old = time.time() - 3600
    os.utime(tmp_path / OWNER, (old, old))
    monkeypatch.setattr(checkpoint_owner, "_refreshed", 0.0)       # its time to renew
    checkpoint_owner.refresh(str(tmp_path))
    assert time.time() - os.path.getmtime(tmp_path / OWNER) < 60
    _claim_of(tmp_path, host="node-3", pid=77)                     # a second run took it over
    assert checkpoint_owner.lost(str(tmp_path)) == (
        f"checkpoint.dir {tmp_path} is now claimed by process 77 on node-3, started earlier: "
        "this run stops without saving, so that the two runs do not mix their checkpoints; "
        "give each run its own checkpoint.dir")
    (tmp_path / OWNER).unlink()                           # deleted: claimed again, goes on
    assert checkpoint_owner.lost(str(tmp_path)) is None
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()
    checkpoint_owner.release(str(tmp_path))               # the run ended: the folder is free
    assert not (tmp_path / OWNER).exists()
    _claim_of(tmp_path, host="node-3", pid=77)            # ... but never another run's claim
    checkpoint_owner.release(str(tmp_path))
    assert (tmp_path / OWNER).exists()


def test_a_run_never_renews_another_runs_claim(tmp_path, monkeypatch):
    """``refresh`` rewrites this run's claim only: another run's (which took the folder over,
    or ended on another host) keeps its time of writing, so it goes stale as its own run
    stops renewing it, and keeps its text."""
    claim = _claim_of(tmp_path, host="node-3", pid=77)
    old = time.time() - checkpoint_owner.STALE_S - 1
    os.utime(tmp_path / OWNER, (old, old))
    monkeypatch.setattr(checkpoint_owner, "_refreshed", 0.0)       # its time to renew
    checkpoint_owner.refresh(str(tmp_path))
    assert time.time() - os.path.getmtime(tmp_path / OWNER) > checkpoint_owner.STALE_S
    assert json.loads((tmp_path / OWNER).read_text()) == claim
    assert checkpoint_owner._refreshed == 0.0
    checkpoint_owner.claim(str(tmp_path))                  # stale: taken over
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()


def test_a_claim_a_full_disk_refuses_is_said_and_leaves_no_file(tmp_path, monkeypatch, capsys):
    """A claim whose write fails (a full disk): at start-up a CheckpointError naming the folder,
    the claim and what to do, not a bare OSError; while training a warning line, the run going
    on; neither leaves write_atomic's temporary file."""
    import errno

    from mimo_data import files

    def full(fd):                    # where a full disk may first say so
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    checkpoint_owner.claim(str(tmp_path))
    monkeypatch.setattr(files.os, "fsync", full)
    monkeypatch.setattr(checkpoint_owner, "_refreshed", 0.0)       # its time to renew
    checkpoint_owner.refresh(str(tmp_path))
    checkpoint_owner.refresh(str(tmp_path))                 # said once, not every step
    assert capsys.readouterr().out == (f"mimo-train: warning: the run's claim {tmp_path / OWNER} "
                                       "was not renewed (No space left on device)\n")
    (tmp_path / OWNER).unlink()
    with pytest.raises(CheckpointError) as refused:
        checkpoint_owner.claim(str(tmp_path))
    assert str(refused.value) == (
        f"checkpoint.dir {tmp_path}: the run's claim {OWNER} cannot be written there (No space "
        "left on device): free space there (an incomplete step folder, one without "
        "integrity.json, may go) or give another checkpoint.dir")
    assert sorted(os.listdir(tmp_path)) == []

    def stopped(fd):                 # Ctrl-C in the middle of a write
        raise KeyboardInterrupt
    monkeypatch.setattr(files.os, "fsync", stopped)
    with pytest.raises(KeyboardInterrupt):
        files.write_atomic(str(tmp_path / "latest"), b"step_0000002")
    assert sorted(os.listdir(tmp_path)) == []
