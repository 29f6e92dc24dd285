"""Crash safety: a build killed at any point leaves no index (so no dataset), and the next build
of the same output starts clean and gives the same bytes as an uninterrupted one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (build_dataset, cli_main, file_bytes, mimo_shard_command, read_json,
                      run_cli, shard_paths, write_jsonl)
from support.launch import session

COPIES = 30          # the corpus' LLaVA records, 30 times: ~1,200 samples, ~25 shards of 50


def _absolute(record: dict, root: Path) -> dict:
    record = dict(record)
    for key in ("image", "images", "audio", "audios"):
        if key in record:
            value = record[key]
            record[key] = (str(root / value) if isinstance(value, str)
                           else [str(root / v) for v in value])
    return record


@pytest.fixture(scope="module")
def big_input(tmp_path_factory, corpus) -> Path:
    records = json.loads((corpus / "llava.json").read_text())
    records += [json.loads(line) for line in (corpus / "llava.jsonl").read_text().splitlines()
                if line.strip()]
    copies = [_absolute(r, corpus) | {"id": f"{r['id']}-copy{k}"}
              for k in range(COPIES) for r in records]
    return write_jsonl(tmp_path_factory.mktemp("big") / "big.jsonl", copies)


def test_killed_build_leaves_no_dataset_and_a_rerun_recovers(capsys, tmp_path, big_input,
                                                             corpus):
    """The build is killed once its first shard is in ``.staging``. Its last record's image is
    a named pipe until then: the build waits on it for good, so it cannot finish before the
    kill however slowly the test gets to it; then the pipe is replaced by the image. A second
    build into the output while the first runs is refused (exit 1, naming the first) and
    leaves its files alone; the killed build's claim does not stop the rerun."""
    from mimo_data.shards.index import DatasetError, read_index

    records = [json.loads(line) for line in big_input.read_text().splitlines()]
    held = next(r for r in records if isinstance(r.get("image"), str))
    image = tmp_path / f"held{Path(held['image']).suffix}"
    os.mkfifo(image)
    source = write_jsonl(tmp_path / "big.jsonl", [*records, {**held, "id": "held",
                                                             "image": str(image)}])
    out = tmp_path / "out"
    args = ["build", str(source), "-o", str(out), "--max-samples-per-shard", "50",
            "--no-progress"]
    staging = out / ".staging"
    deadline = time.monotonic() + 600                  # a hang guard: the shard takes seconds
    with session([*mimo_shard_command(), *args], stdout=subprocess.DEVNULL,
                 stderr=subprocess.PIPE) as process:
        assert process.stderr is not None
        while not list(staging.glob("*.tar")):
            assert process.poll() is None, (
                f"the build ended (exit {process.returncode}) before a shard appeared: "
                f"{process.stderr.read().decode()}")
            assert time.monotonic() < deadline, "no shard appeared in .staging"
            time.sleep(0.01)
        staged = {p.name: p.stat().st_size for p in staging.iterdir()}
        # (other inputs: a build that went ahead would not wait on the pipe)
        code, _, err = cli_main(capsys, "build", corpus / "llava.jsonl", "-o", out,
                                "--no-progress")
        assert code == 1, err
        assert err.startswith(f"mimo-shard build: error: {out} is being written by mimo-shard "
                              f"build (pid {process.pid} on {socket.gethostname()}, started "), err
        assert err.rstrip().endswith("; wait for it to end, or choose another --output"), err
        assert process.poll() is None, "the build finished before it could be killed"
        after = {p.name: p.stat().st_size for p in staging.iterdir()}   # (more, as it goes on)
        assert all(after.get(name, -1) >= size for name, size in staged.items()), (staged, after)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL
    image.unlink()
    image.write_bytes(Path(held["image"]).read_bytes())

    assert out.is_dir() and not (out / "index.json").exists()
    with pytest.raises(DatasetError, match="index.json"):
        read_index(str(out))
    info = run_cli("info", out, check_rc=1)
    assert "index.json" in info.stderr and "Traceback" not in info.stderr

    rerun = run_cli(*args, check_rc=0)
    assert "Traceback" not in rerun.stderr
    assert not staging.exists()

    build_dataset([source], tmp_path / "reference", max_samples_per_shard=50)
    recovered, reference = file_bytes(out), file_bytes(tmp_path / "reference")
    assert sorted(recovered) == sorted(reference)
    assert len(shard_paths(out)) > 10
    for name in reference:
        assert recovered[name] == reference[name], f"{name} differs from an uninterrupted build"


def test_a_terminated_build_removes_its_files_and_gives_back_its_claim(s3, tmp_path, corpus):
    """SIGTERM (a scheduler's cancel or time limit) unwinds a build into a bucket as Ctrl-C
    does: exit 143, one line, its local staging removed, and its claim on the prefix given
    back, so the next build need not wait for it to lapse. The build waits on a named pipe
    (its record's image) until the signal comes."""
    import fsspec

    s3.make_bucket("mimo-test-crash")
    image = tmp_path / "held.jpg"
    os.mkfifo(image)
    source = write_jsonl(tmp_path / "held.jsonl", [{"id": "held", "image": str(image),
                                                    "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]}])
    url, staging_root = "s3://mimo-test-crash/held", tmp_path / "tmp"
    staging_root.mkdir()
    fs = fsspec.filesystem("s3", **s3.storage_options)
    deadline = time.monotonic() + 300                 # a hang guard: start-up takes seconds
    with session([*mimo_shard_command(), "build", source, "-o", url, "--no-progress",
                  "--workers", "0"], env={**os.environ, **s3.env(), "TMPDIR": str(staging_root)},
                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as process:
        assert process.stderr is not None
        while not fs.exists("mimo-test-crash/held/.mimo-claim"):
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "the build never claimed its output"
            time.sleep(0.05)
        time.sleep(0.5)                               # (on to the record: its pipe)
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(60) == 143
        err = process.stderr.read().decode()
        process.stderr.close()
    assert err.strip() == ("mimo-shard build: terminated: no new index was written (under "
                           "--overwrite the old dataset stays, unless its replacement had "
                           "begun); run it again"), err
    assert fs.find("mimo-test-crash/held") == [] and list(staging_root.iterdir()) == []


def _complete_copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_rebuild_after_a_kill_between_moving_files_and_writing_the_index(
        capsys, tmp_path, corpus_build, good_records):
    """Shards and tables already moved out of .staging, index.json not yet written."""
    from conftest import cli_main

    out = _complete_copy(corpus_build, tmp_path / "out")
    (out / "index.json").unlink()
    source = write_jsonl(tmp_path / "small.jsonl", good_records)
    code, _, err = cli_main(capsys, "build", source, "-o", out, "--no-progress")
    assert code == 0, err
    assert read_json(out / "index.json")["totals"]["samples"] == len(good_records)
    assert len(shard_paths(out)) == 1


def test_rebuild_after_a_kill_while_writing_the_index(capsys, tmp_path, corpus_build,
                                                       good_records):
    """Killed inside the atomic write of index.json: its temporary file is left behind."""
    from conftest import cli_main

    out = _complete_copy(corpus_build, tmp_path / "out")
    index = (out / "index.json").read_bytes()
    (out / "index.json").unlink()
    (out / "index.json.tmp-4242").write_bytes(index[: len(index) // 2])
    source = write_jsonl(tmp_path / "small.jsonl", good_records)
    code, _, err = cli_main(capsys, "build", source, "-o", out, "--no-progress")
    assert code == 0, err
    assert read_json(out / "index.json")["totals"]["samples"] == len(good_records)
    assert not (out / "index.json.tmp-4242").exists()
