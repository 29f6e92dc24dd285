"""Datasets at an object-store URL (the local S3 of tools/object_store.py: moto behind a proxy
that counts requests and injects faults).

Asserted: ``mimo-shard build --output s3://...`` puts in the bucket exactly the files (names and
bytes) that a local build of the same inputs and options writes, and ``info`` / ``verify`` on
the URL agree with the local copy; a shard object with one changed byte fails ``verify``, which
names it. A build that dies midway leaves no index.json (readers refuse the prefix), and the
next build into the prefix leaves no object of the dead one; with --overwrite, one that dies or
keeps no sample leaves the old dataset whole, and one that completes replaces it. One build at
a time writes a prefix: a second is refused naming the first and touches nothing, a killed
one's stale claim is taken over, and a build whose claim is taken over stops; a renewal or
a take-over never overwrites a claim another build wrote since its look (If-Match). ShardReader on
the URL gives the records and member bytes that ``tarfile`` reads from the local build's tars;
its records cost no request, and a prefetch of every sample costs one GET per shard. Without the
bucket's ``.mimo-cache/`` the records are derived from the shards. Injected 500s, resets and
truncated bodies are retried to the exact bytes; a read that keeps failing raises StorageError
naming the shard's URL. ``mimo-inspect report`` on the URL counts what it counts on the local
copy, and a training config keeps URLs as given and redacts secrets of ``data.storage_options``
when written out. At an ``http://`` URL (tools/object_store.py's LocalHTTP: a directory served
with byte ranges, no listing) a dataset reads, prefetches, ``info``s and ``verify``s like the
local copy, its tables downloaded from its ``.mimo-cache/``.

Expected values come from the local build read with ``tarfile`` / pyarrow, or from the same
command run on the local build, never from the remote code path itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest

from conftest import (CORPUS_DIR, all_samples, build_dataset, cli_main, file_bytes,
                      preprocess_config_file, run_cli, shard_paths)
from mimo_data.shards import storage
from mimo_data.shards.build import BuildOptions, build
from mimo_data.shards.index import DatasetError, read_index
from mimo_data.shards.reader import ShardReader
from mimo_data.shards.stops import BuildError
from mimo_data.shards.storage import StorageError
from tools.object_store import Faults, LocalHTTP, LocalS3

BUCKET = "mimo-test-remote-dataset"     # moto's buckets are process-wide: a name of its own
INPUTS = ("llava.jsonl", "speech_manifest.jsonl")
PER_SHARD = 8


@dataclass
class Built:
    local: Path                   # the local build of INPUTS
    files: dict[str, bytes]       # its files right after the build, by relative path
    samples: list                 # [(shard, key, {member: bytes})] read with tarfile
    url: str                      # the same inputs built by the CLI into the bucket
    stderr: str                   # that build's stderr


def _fs(s3: LocalS3):
    return fsspec.filesystem("s3", **s3.storage_options)


def _objects(s3: LocalS3, prefix: str) -> dict[str, bytes]:
    """``{path relative to prefix: bytes}`` of every object under ``BUCKET/prefix``."""
    fs = _fs(s3)
    root = f"{BUCKET}/{prefix}/"
    return {path[len(root):]: fs.cat_file(path) for path in fs.find(root)}


def _upload(s3: LocalS3, files: dict[str, bytes], prefix: str) -> str:
    fs = _fs(s3)
    for name, data in files.items():
        fs.pipe_file(f"{BUCKET}/{prefix}/{name}", data)
    return f"s3://{BUCKET}/{prefix}"


@pytest.fixture(scope="module")
def store(local_s3) -> LocalS3:
    local_s3.make_bucket(BUCKET)
    return local_s3


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch) -> Path:
    """Every test's derived tables in a cache of its own: a reader starts from nothing."""
    cache = tmp_path / "mimo-cache"
    monkeypatch.setenv("MIMO_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="module")
def built(store, corpus, tmp_path_factory) -> Built:
    inputs = [str(corpus / name) for name in INPUTS]
    local = tmp_path_factory.mktemp("remote-local") / "ds"
    build_dataset(inputs, local, max_samples_per_shard=PER_SHARD)
    files = file_bytes(local)
    url = f"s3://{BUCKET}/ds"
    env = {**os.environ, **store.env(),
           "MIMO_CACHE_DIR": str(tmp_path_factory.mktemp("remote-build-cache"))}
    result = run_cli("build", *inputs, "--output", url, "--max-samples-per-shard", PER_SHARD,
                     "--no-progress", env=env, check_rc=0)
    return Built(local, files, all_samples(local), url, result.stderr)


@pytest.fixture
def s3_env(s3, monkeypatch) -> LocalS3:
    """The store's endpoint and credentials in this process's environment (what the CLIs and
    readers opened without storage options use)."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return s3


# ------------------------------------------------------------------------------------ build

def test_bucket_holds_the_files_of_a_local_build(s3, built):
    objects = _objects(s3, "ds")
    assert set(objects) == set(built.files), "objects differ from the local build's files"
    assert any(name.startswith(".mimo-cache/records-") for name in objects)
    assert any(name.startswith(".mimo-cache/samples-") for name in objects)
    shards = len(shard_paths(built.local))
    assert shards == -(-len(built.samples) // PER_SHARD) > 1
    for name, data in objects.items():
        if name != "index.json":
            assert data == built.files[name], f"{name}: bytes differ from the local build's"
    remote_index, local_index = json.loads(objects["index.json"]), \
        json.loads(built.files["index.json"])
    remote_build, local_build = remote_index.pop("build"), local_index.pop("build")
    assert remote_index == local_index                   # shards, totals, files' sha256 ...
    assert remote_build["inputs"] == local_build["inputs"]
    assert {k: v for k, v in remote_build.items() if "output" not in k} == \
        {k: v for k, v in local_build.items() if "output" not in k}
    assert built.url in built.stderr                     # the build's summary names it


def test_info_and_verify_on_the_url_agree_with_the_local_copy(capsys, s3_env, built):
    code, out, err = cli_main(capsys, "info", built.url, "--json")
    assert code == 0, err
    remote = json.loads(out)
    code, out, err = cli_main(capsys, "info", built.local, "--json")
    assert code == 0, err
    local = json.loads(out)
    assert remote.pop("directory") == built.url
    local.pop("directory")
    assert remote == local
    assert remote["samples"] == len(built.samples)
    assert remote["shards"] == len(shard_paths(built.local))
    assert remote["bytes"] == sum(p.stat().st_size for p in shard_paths(built.local))

    for directory in (built.url, built.local):
        code, out, err = cli_main(capsys, "verify", directory, "--no-progress")
        assert code == 0, err
        assert "OK" in out


def test_verify_names_the_shard_object_with_a_changed_byte(capsys, s3_env, built):
    shard = shard_paths(built.local)[1].name
    row = next(r for r in pq.read_table(built.local / "samples.parquet").to_pylist()
               if r["shard"] == shard)
    member = next(m for m in row["members"] if m["name"] == "json")
    files = dict(built.files)
    data = bytearray(files[shard])
    data[member["offset"] + member["size"] // 2] ^= 0xFF
    files[shard] = bytes(data)
    url = _upload(s3_env, files, "damaged")

    code, out, err = cli_main(capsys, "verify", url, "--no-progress")
    assert code == 1
    assert "FAILED" in err and "OK" not in out
    problems = [line for line in err.splitlines() if line.startswith("verify: ")]
    assert problems and all(shard in line for line in problems), err
    assert any(f"sample {row['key']} member {row['key']}.json" in line for line in problems), err


def test_a_build_into_a_missing_bucket_stops_before_reading_its_inputs(capsys, s3_env, corpus,
                                                                      monkeypatch):
    """The bucket is written to first: a missing one is a usage error naming the output
    (exit 2, one line), before a record is read."""
    url = "s3://mimo-no-such-bucket/ds"
    code, _, err = cli_main(capsys, "build", corpus / INPUTS[0], "--output", url,
                            "--no-progress")
    assert code == 2, err
    assert err.strip() == (f"mimo-shard build: error: cannot write to --output {url}: its "
                           f"bucket does not exist at the endpoint {s3_env.endpoint_url}; create "
                           "it first, or check the URL and the endpoint"), err
    assert s3_env.requests["GET"] <= 1 and s3_env.requests["PUT"] == 1, dict(s3_env.requests)
    # an endpoint that is no S3 store (a web server answering 404 to all): said so, not as a
    # bucket to create
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length and self.headers.get("Expect"):
                self.send_response(100)
                self.end_headers()
            self.rfile.read(length)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = answer

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    web = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", web)
    code, _, err = cli_main(capsys, "build", corpus / INPUTS[0], "--output", url,
                            "--no-progress")
    assert code == 2 and f"cannot write to --output {url}: the endpoint {web} answers 404 Not " \
        "Found without S3's NoSuchBucket: is it an S3 store?" in err, err
    # reading there (info, verify, training's start-up): the same, not "no such bucket"
    code, _, err = cli_main(capsys, "info", url)
    server.shutdown()
    assert code == 2 and f"{url}: the endpoint {web} answers 404 Not Found without S3's " \
        "NoSuchBucket" in err, err


def test_a_build_that_dies_midway_leaves_no_dataset_or_the_old_one_and_the_next_one_cleans_up(
        s3, built, tmp_path, monkeypatch):
    url = f"s3://{BUCKET}/atomic"
    inputs = [str(CORPUS_DIR / name) for name in INPUTS]
    staging_root = tmp_path / "tmp"
    staging_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging_root))
    real_put = storage.Remote.put
    uploaded: list[str] = []

    def put_until_the_sixth(self, path, target):
        if len(uploaded) == 5:
            raise StorageError(f"writing {target}: the network went away (test)")
        real_put(self, path, target)
        uploaded.append(target)

    with monkeypatch.context() as patch:
        patch.setattr(storage.Remote, "put", put_until_the_sixth)
        # 2 samples per shard: more shards than the next build writes
        with pytest.raises(StorageError):
            build(inputs, url, BuildOptions(max_samples_per_shard=2, workers=0, progress=False),
                  s3.storage_options)
    # the shards it uploaded as they were completed removed again: beside no index nor
    # claim, a next build could not tell them from tars of the user's own
    assert len(uploaded) == 5 and _objects(s3, "atomic") == {}
    assert list(staging_root.iterdir()) == []                   # local staging removed
    with pytest.raises(DatasetError, match="nothing there, no such dataset"):
        read_index(url, s3.storage_options)
    # a build killed while uploading leaves its shards and its claim, which the next build
    # takes over (once stale), removing them; tars beside no killed build's claim (a
    # WebDataset of the user's, named as shards are) are refused and stay
    from mimo_data.shards import claim
    fs = _fs(s3)
    long_ago = time.time() - 3600
    fs.pipe_file(f"{BUCKET}/atomic/.mimo-claim", claim.Claimant(
        "killed", "mimo-shard build", "node-7", 4242, long_ago, long_ago).encoded())
    mine = f"s3://{BUCKET}/mine"
    for name in ("data-000000.tar", "data-000007.tar"):
        fs.pipe_file(f"{BUCKET}/atomic/{name}", b"a killed build's shard")
        fs.pipe_file(f"{BUCKET}/mine/{name}", b"a user's tar")
    with monkeypatch.context() as patch:
        patch.setattr(claim, "STALE_S", 0.0)
        patch.setattr(claim, "READ_BACK_S", 0.0)
        with pytest.raises(BuildError, match=r"holds objects a build did not write "
                           r"\(data-000000.tar, data-000007.tar\).*`mimo-shard index`"):
            build(inputs, mine, BuildOptions(workers=0, progress=False), s3.storage_options)
        assert set(_objects(s3, "mine")) == {"data-000000.tar", "data-000007.tar"}

        build(inputs, url, BuildOptions(max_samples_per_shard=PER_SHARD, workers=0,
                                        progress=False), s3.storage_options)
    objects = _objects(s3, "atomic")
    assert set(objects) == set(built.files)
    index = json.loads(objects["index.json"])
    assert {n for n in objects if n.endswith(".tar")} == {s["name"] for s in index["shards"]}
    for name in objects:
        if name.endswith(".tar") or name == "samples.parquet":
            assert objects[name] == built.files[name], name

    # --overwrite: a build that dies midway (its shards went under .staging/, removed)
    # leaves the dataset it was to replace whole and readable
    uploaded.clear()
    with monkeypatch.context() as patch:
        patch.setattr(storage.Remote, "put", put_until_the_sixth)
        with pytest.raises(StorageError):
            build(inputs, url, BuildOptions(max_samples_per_shard=2, workers=0, progress=False,
                                            overwrite=True), s3.storage_options)
    assert _objects(s3, "atomic") == objects and len(uploaded) == 5
    assert len(ShardReader(url, storage_options=s3.storage_options)) == \
        index["totals"]["samples"]
    # one that keeps no sample leaves it too, its report beside it
    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text(json.dumps({"id": "gone", "image": "absent.jpg", "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A."}]}) + "\n")
    kept = build([str(nothing)], url, BuildOptions(workers=0, progress=False, overwrite=True),
                 s3.storage_options)
    assert kept["totals"]["samples"] == 0
    left = _objects(s3, "atomic")
    assert json.loads(left.pop("report.failed.json"))["records_skipped"] == 1
    assert json.loads(left.pop("skipped.failed.jsonl"))["location"] == f"{nothing}:1"
    assert left == objects
    # one whose swap fails (its moves of the shards) says that neither dataset is there now
    real_move, moves = storage.Remote.move, []

    def move_one(self, url, to):
        moves.append(url)                   # the first call alone moves (list.append: atomic)
        if len(moves) > 1:
            raise StorageError(f"moving {url}: the network went away (test)")
        real_move(self, url, to)

    with monkeypatch.context() as patch:
        patch.setattr(storage.Remote, "move", move_one)
        with pytest.raises(StorageError, match=f"while replacing the dataset at {url}, whose "
                           "index was removed, so neither it nor the new one is there .*build "
                           "again with --overwrite"):
            build(inputs, url, BuildOptions(max_samples_per_shard=2, workers=0, progress=False,
                                            overwrite=True), s3.storage_options)
    assert "index.json" not in _objects(s3, "atomic") and len(moves) > 1
    # one that completes takes its place: the new files alone
    build(inputs, url, BuildOptions(max_samples_per_shard=2, workers=0, progress=False,
                                    overwrite=True), s3.storage_options)
    objects = _objects(s3, "atomic")
    index = json.loads(objects["index.json"])
    assert {n for n in objects if n.endswith(".tar")} == {s["name"] for s in index["shards"]}
    assert len(index["shards"]) == -(-index["totals"]["samples"] // 2)
    assert not [n for n in objects if n.startswith(".staging") or n == "report.failed.json"]


def test_one_build_at_a_time_writes_a_prefix(capsys, s3, s3_env, built, monkeypatch):
    """A build into a prefix another build is writing is refused (exit 1, naming the other
    and when its claim would lapse) and touches nothing there; the first completes the same
    dataset as alone (its claim renewed meanwhile, so never stale). A claim not renewed for
    ``STALE_S`` by the store's clock (a killed build's) is taken over, said; one whose writer's
    clock is behind is not. A build whose claim another took over uploads no more shards and
    writes no index, leaving the other's claim where it is."""
    import socket
    import subprocess
    import threading

    from mimo_data.shards import claim

    monkeypatch.setattr(claim, "READ_BACK_S", 0.0)
    # renewed every 0.1 s: never stale while the first build lives (the store's clock says
    # seconds: S3's LastModified); a claim the test writes must stay fresh until a build
    # started just after it reads it: on a loaded CI machine that took over 3 s
    monkeypatch.setattr(claim, "STALE_S", 6.0)
    monkeypatch.setattr(claim, "RENEW_S", 0.1)
    url, fs = f"s3://{BUCKET}/claimed", _fs(s3)
    inputs = [str(CORPUS_DIR / name) for name in INPUTS]
    options = BuildOptions(max_samples_per_shard=PER_SHARD, workers=0, progress=False)
    real_put, uploading, go_on = storage.Remote.put, threading.Event(), threading.Event()

    def put_and_wait(self, path, target):     # the first build waits after its first shard
        real_put(self, path, target)
        if threading.current_thread() is runner:
            uploading.set()
            assert go_on.wait(60), "the test never let the first build go on"

    first: dict = {}

    def first_build() -> None:
        try:
            first["index"] = build(inputs, url, options, s3.storage_options)
        except BaseException as exc:            # said by the assertion below
            first["error"] = exc

    with monkeypatch.context() as patch:
        patch.setattr(storage.Remote, "put", put_and_wait)
        runner = threading.Thread(target=first_build)
        runner.start()
        try:
            assert uploading.wait(60), f"the first build uploaded no shard: {first}"
            time.sleep(claim.STALE_S + 0.5)
            before = _objects(s3, "claimed")
            code, _, err = cli_main(capsys, "build", *inputs, "--output", url, "--no-progress")
            after = _objects(s3, "claimed")
            token = [json.loads(files.pop(".mimo-claim"))["token"] for files in (before, after)]
            assert after == before and token[0] == token[1]
        finally:
            go_on.set()
            runner.join(120)
    assert code == 1, err
    assert err.startswith(f"mimo-shard build: error: {url} is being written by mimo-shard "
                          f"build (pid {os.getpid()} on {socket.gethostname()}, started "), err
    assert re.search(r"; wait for it to end \(if it was killed, its claim lapses in about "
                     r"[1-6] s, at ", err) and err.rstrip().endswith(
            " by this host's clock; if you are sure it is no longer running, delete "
            f"{url}/.mimo-claim), or choose another --output"), err
    assert "error" not in first, first
    done = _objects(s3, "claimed")
    assert set(done) == set(built.files)
    assert all(done[name] == built.files[name] for name in done
               if name.endswith(".tar") or name == "samples.parquet")

    # (from here a claim not renewed lapses after 60 s, not 6: a build's start on a busy
    # machine, seconds after the claim below is written, stays under it)
    monkeypatch.setattr(claim, "STALE_S", 60.0)
    # a store that ignores the conditional write: a live claim is still looked at first
    fs.rm(f"{BUCKET}/claimed", recursive=True)
    live = claim.Claimant("live", "mimo-shard build", "node-6", 77, time.time(), time.time())
    fs.pipe_file(f"{BUCKET}/claimed/.mimo-claim", live.encoded())
    with monkeypatch.context() as patch:
        patch.setattr(storage.Remote, "create", lambda self, u, data: self.write(u, data) or "")
        code, _, err = cli_main(capsys, "build", *inputs, "--output", url, "--no-progress")
    assert code == 1 and "is being written by mimo-shard build (pid 77 on node-6" in err, err
    assert _objects(s3, "claimed") == {".mimo-claim": live.encoded()}

    # a claim whose writer's clock is behind (it says long ago; the store, just now): refused,
    # said killed where its pid is this host's and gone; once not renewed for STALE_S by the
    # store's clock: taken over
    fs.rm(f"{BUCKET}/claimed", recursive=True)
    long_ago = time.time() - claim.STALE_S - 60
    fs.pipe_file(f"{BUCKET}/claimed/.mimo-claim", claim.Claimant(
        "killed", "mimo-shard build", "node-7", 4242, long_ago, long_ago).encoded())
    code, _, err = cli_main(capsys, "build", *inputs, "--output", url, "--no-progress")
    assert code == 1 and "is being written by mimo-shard build (pid 4242 on node-7" in err, err
    # one of this host whose process has ended: lapsed once two renewals are missed, not
    # STALE_S (renewals every 1.5 s here: 3 s)
    ended = subprocess.Popen(["true"])
    ended.wait()
    monkeypatch.setattr(claim, "RENEW_S", 1.5)
    # ... where the claim names this host's name alone (another container of that name, on
    # its network: its pids are not this one's), it is a live run's until STALE_S
    fs.pipe_file(f"{BUCKET}/claimed/.mimo-claim", claim.Claimant(
        "container", "mimo-shard build", socket.gethostname(), ended.pid, time.time(),
        time.time()).encoded())
    time.sleep(2 * claim.RENEW_S + 1)
    code, _, err = cli_main(capsys, "build", *inputs, "--output", url, "--no-progress")
    assert code == 1 and f"{url} is being written by mimo-shard build (pid {ended.pid} on " \
        f"{socket.gethostname()}, started " in err, err
    here = claim.Claimant("here", "mimo-shard build", claim.this_host(), ended.pid,
                          time.time(), time.time())
    fs.pipe_file(f"{BUCKET}/claimed/.mimo-claim", here.encoded())
    code, _, err = cli_main(capsys, "build", *inputs, "--output", url, "--no-progress")
    assert code == 1 and f"was being written by mimo-shard build (pid {ended.pid} on " \
        f"{socket.gethostname()}, started " in err and "which has ended without giving its " \
        "claim back (killed, or stopped by an error): its claim lapses in about " in err and \
        "; build again then (or now, " f"once you delete {url}/.mimo-claim)" in err, err
    time.sleep(2 * claim.RENEW_S + 1)       # within STALE_S of its write
    code, _, err = cli_main(capsys, "build", *inputs, "--output", url, "--no-progress",
                            "--max-samples-per-shard", PER_SHARD)
    assert code == 0, err
    assert err.startswith(f"mimo-shard: taking over {url} from mimo-shard build (pid "
                          f"{ended.pid} on {socket.gethostname()}, started "), err
    assert "ago (its process has ended)" in err, err
    assert set(_objects(s3, "claimed")) == set(built.files)

    # a build whose claim another takes over after its first shard stops there
    fs.rm(f"{BUCKET}/claimed", recursive=True)
    other = claim.Claimant("other", "mimo-shard build", "node-8", 99, time.time(), time.time())
    puts: list[str] = []

    def put_then_taken_over(self, path, target):
        puts.append(target)
        real_put(self, path, target)
        fs.pipe_file(f"{BUCKET}/claimed/.mimo-claim", other.encoded())

    with monkeypatch.context() as patch:
        patch.setattr(storage.Remote, "put", put_then_taken_over)
        with pytest.raises(claim.OutputBusy, match=f"mimo-shard build \\(pid 99 on node-8, "
                           f"started .*\\) took over {url}, replacing this run's claim .* it "
                           "stopped without writing an index and leaves the output to the "
                           "other"):
            build(inputs, url, BuildOptions(max_samples_per_shard=2, workers=0,
                                            progress=False), s3.storage_options)
    left = _objects(s3, "claimed")
    assert puts == [f"{url}/data-000000.tar"] and "index.json" not in left
    assert left[".mimo-claim"] == other.encoded()
    # ... and one whose claim is gone (deleted, the bucket reset): said so, not "taken over"
    fs.rm(f"{BUCKET}/claimed", recursive=True)

    def put_then_claim_gone(self, path, target):
        real_put(self, path, target)
        fs.rm(f"{BUCKET}/claimed/.mimo-claim")

    with monkeypatch.context() as patch:
        patch.setattr(storage.Remote, "put", put_then_claim_gone)
        with pytest.raises(claim.OutputBusy, match=re.escape(
                f"this run's claim {url}/.mimo-claim is gone (deleted, or the bucket or its "
                "prefix was removed or reset meanwhile): it stopped without writing an index")):
            build(inputs, url, BuildOptions(max_samples_per_shard=2, workers=0,
                                            progress=False), s3.storage_options)
    assert "index.json" not in _objects(s3, "claimed")


# ----------------------------------------------------------------------------------- reader

def test_a_claim_is_renewed_and_taken_over_only_over_what_this_run_wrote(store, monkeypatch):
    """S3's conditional write (If-Match on the claim's ETag): a claim another run wrote after
    this run's last write is never overwritten by a renewal, even where it comes right after
    this run looked at the claim (the renewal stops, the other's claim stays, the next confirm
    refuses); two runs taking over one stale claim at once: the later one is refused, naming
    the first, whose claim stays."""

    from mimo_data.shards import claim

    monkeypatch.setattr(claim, "READ_BACK_S", 0.0)
    monkeypatch.setattr(claim, "RENEW_S", 3600.0)       # renewed here by hand, not by the thread
    url, fs = f"s3://{BUCKET}/raced", _fs(store)
    remote = storage.Remote(url, store.storage_options)
    other = claim.Claimant("other", "mimo-shard build", "node-9", 98, time.time(), time.time())
    real_read, looked = storage.Remote.read, []

    def read_then_other_writes(self, u):     # the other run writes right after any look
        data = real_read(self, u)
        if u.endswith(".mimo-claim") and not looked:
            looked.append(u)
            fs.pipe_file(f"{BUCKET}/raced/.mimo-claim", other.encoded())
        return data

    with claim.held(url, "mimo-shard build", remote) as held:
        monkeypatch.setattr(storage.Remote, "read", read_then_other_writes)
        try:
            held._renew_once()               # (its look, if any, lets the other write)
            if not looked:                   # (none: the other writes now)
                read_then_other_writes(remote, storage.join(url, ".mimo-claim"))
            with pytest.raises(claim.OutputBusy, match="node-9"):
                held._renew_once()
        finally:
            monkeypatch.setattr(storage.Remote, "read", real_read)
        assert fs.cat_file(f"{BUCKET}/raced/.mimo-claim") == other.encoded()
        with pytest.raises(claim.OutputBusy, match=r"pid 98 on node-9.* took over"):
            held.confirm()
    assert fs.cat_file(f"{BUCKET}/raced/.mimo-claim") == other.encoded()   # end() left it

    # a stale claim taken over by another run between this run's look at its age and its write
    long_ago = time.time() - 3600
    fs.pipe_file(f"{BUCKET}/raced/.mimo-claim", claim.Claimant(
        "killed", "mimo-shard build", "node-7", 4242, long_ago, long_ago).encoded())
    monkeypatch.setattr(claim, "STALE_S", 0.0)
    real_age = claim.Claim._age

    def age_then_other_takes_over(self, holder):
        found = real_age(self, holder)
        fs.pipe_file(f"{BUCKET}/raced/.mimo-claim", other.encoded())
        return found

    monkeypatch.setattr(claim.Claim, "_age", age_then_other_takes_over)
    with pytest.raises(claim.OutputBusy, match="is being written by mimo-shard build "
                       r"\(pid 98 on node-9"):
        with claim.held(url, "mimo-shard build", remote):
            pass
    assert fs.cat_file(f"{BUCKET}/raced/.mimo-claim") == other.encoded()


def test_remote_reader_gives_the_local_tars_records_and_members(s3, built):
    reader = ShardReader(built.url, storage_options=s3.storage_options)
    assert len(reader) == len(built.samples)
    for position, (shard, key, members) in enumerate(built.samples):
        assert (reader.table.shard(position), reader.table.key(position)) == (shard, key)
        assert reader.record(position) == json.loads(members["json"])
        assert set(reader.table.members(position)) == set(members)
        for name, data in members.items():
            assert reader.read_member(position, name) == data, (key, name)
    reader.close()


def test_remote_records_cost_no_request_after_opening(s3, built):
    reader = ShardReader(built.url, storage_options=s3.storage_options)
    s3.reset_counters()
    records = [reader.record(position) for position in range(len(reader))]
    assert sum(s3.requests.values()) == 0, dict(s3.requests)
    assert records == [json.loads(members["json"]) for _, _, members in built.samples]
    reader.close()


def test_prefetch_reads_each_shard_in_one_request(s3, built):
    reader = ShardReader(built.url, storage_options=s3.storage_options)
    s3.reset_counters()
    reader.prefetch(range(len(reader)))
    for position, (_, key, members) in enumerate(built.samples):
        for name, data in members.items():
            assert reader.read_member(position, name) == data, (key, name)
    shards = len(shard_paths(built.local))
    assert s3.requests["GET"] == shards, dict(s3.requests)
    assert sum(s3.requests.values()) == shards, dict(s3.requests)
    reader.close()


def test_records_are_derived_from_the_shards_without_the_bucket_cache(s3, built, fresh_cache):
    url = _upload(s3, {name: data for name, data in built.files.items()
                       if not name.startswith(".mimo-cache/")}, "nocache")
    reader = ShardReader(url, storage_options=s3.storage_options)
    assert [reader.record(p) for p in range(len(reader))] == \
        [json.loads(members["json"]) for _, _, members in built.samples]
    assert list(fresh_cache.glob("*/records-*.arrow")), "no records table was saved"
    assert not any(name.startswith(".mimo-cache") for name in _objects(s3, "nocache"))
    position = len(reader) - 1
    _, _, members = built.samples[position]
    for name, data in members.items():
        assert reader.read_member(position, name) == data
    reader.close()


# ----------------------------------------------------------------------------------- faults

def test_which_http_replies_are_retried():
    """A server's error, throttling (429: an HTTP dataset's server, a hub's) and a request
    timeout are tried again; a refusal, a missing object or a method the server does not
    implement (501: a web server where an S3 store was meant) is not."""
    import errno

    import aiohttp

    def reply(status: int) -> aiohttp.ClientResponseError:
        return aiohttp.ClientResponseError(None, (), status=status)     # type: ignore[arg-type]
    assert [status for status in (400, 403, 404, 408, 416, 429, 500, 501, 502, 503)
            if storage._transient(reply(status))] == [408, 429, 500, 502, 503]
    # s3fs's own translation of a 501 reply to a PUT
    assert not storage._transient(OSError(errno.ENOSYS, "Not Implemented"))
    assert storage._transient(OSError(errno.ECONNRESET, "Connection reset by peer"))


def test_injected_faults_are_retried_to_the_exact_bytes(s3, built, monkeypatch, capsys):
    monkeypatch.setattr(storage, "BACKOFF_S", 0.01)
    retried = sum(storage.RETRIES.values())
    s3.faults = Faults(rate=0.2, kinds=("500", "reset", "truncate"), seed=7)
    reader = ShardReader(built.url, storage_options=s3.storage_options)
    for position, (_, key, members) in enumerate(built.samples):
        assert reader.record(position) == json.loads(members["json"])
        for name, data in members.items():
            assert reader.read_member(position, name) == data, (key, name)
    reader.close()
    assert sum(s3.injected.values()) > 0, "no fault was injected: the retries went untested"
    # botocore's and s3fs's retries are off: every 500 and cut body is a counted retry of
    # mimo's (a reset may also be absorbed by aiohttp reconnecting)
    counted = sum(storage.RETRIES.values()) - retried
    assert s3.injected["500"] + s3.injected["truncate"] <= counted <= sum(s3.injected.values())
    # each retry said on a line of its own
    import re
    said = [line for line in capsys.readouterr().err.splitlines() if "; retry " in line]
    assert said and all(re.fullmatch(r"mimo: reading s3://\S+( bytes \d+-\d+)?: \w+ \(.*\); "
                                     r"retry \d of 5 in \d+\.\ds", line) for line in said), said


def test_a_read_that_keeps_failing_raises_storage_error_naming_the_shard(
        s3, built, monkeypatch):
    monkeypatch.setattr(storage, "BACKOFF_S", 0.01)
    monkeypatch.setattr(storage, "ATTEMPTS", 2)
    reader = ShardReader(built.url, storage_options=s3.storage_options)
    position = len(reader) - 1
    s3.faults = Faults(rate=1.0, kinds=("truncate",))
    with pytest.raises(StorageError) as failed:
        reader.read_member(position, "json")
    shard_url = f"{built.url}/{built.samples[position][0]}"
    assert shard_url in str(failed.value)
    assert s3.injected["truncate"] >= 2
    reader.close()


def test_a_missing_bucket_and_a_misspelt_profile_are_said_at_once(s3, store, monkeypatch,
                                                                   tmp_path):
    """Training's start-up tells a bucket that does not exist from a dataset not built yet;
    a credentials profile that does not exist, or no credentials at all, is no fault a retry
    mends."""
    assert storage.bucket_absence(f"s3://{BUCKET}/ds", s3.storage_options) is None
    assert storage.bucket_missing("s3://no-such-bucket-here/ds", s3.storage_options,
                                  storage.bucket_absence("s3://no-such-bucket-here/ds",
                                                         s3.storage_options)).startswith(
        "its bucket does not exist at the endpoint")
    retried = sum(storage.RETRIES.values())
    with pytest.raises(StorageError, match=r"The config profile \(tema\) could not be found: "
                       "check AWS_PROFILE"):
        storage.exists(f"s3://{BUCKET}/ds/index.json", {**s3.storage_options, "profile": "tema"})
    # no credentials anywhere: said as none found (not "access denied"), with where they go
    anonymous = {k: v for k, v in s3.storage_options.items() if k not in ("key", "secret")}
    with monkeypatch.context() as env:
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            env.delenv(name)
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        env.setenv("AWS_CONFIG_FILE", os.devnull)
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")         # no instance's role either
        with pytest.raises(StorageError, match=r"no credentials found \(NoCredentialsError: .*"
                           r"Give the credentials \(the environment's variables, e.g. "
                           "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") as refused:
            storage.exists(f"s3://{BUCKET}/ds/index.json", anonymous)
        # the endpoint the request went to named: the options', else the environment's,
        # else AWS's own
        assert f"(endpoint {s3.endpoint_url}): no credentials found" in str(refused.value)
        assert storage.endpoint_of("s3://b/x", {}) == "AWS's own: no endpoint_url given"
        (tmp_path / "aws-config").write_text("[default]\nendpoint_url = http://ceph:7480\n")
        env.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
        assert storage.endpoint_of("s3://b/x", {}) == "http://ceph:7480"
        # the per-service form AWS documents (a services section), as botocore reads it
        (tmp_path / "aws-config").write_text("[default]\nservices = mine\n[services mine]\n"
                                             "s3 =\n  endpoint_url = http://services-s3:9000\n")
        assert storage.endpoint_of("s3://b/x", {}) == "http://services-s3:9000"
        env.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
        assert storage.endpoint_of("s3://b/x", {}) == "http://minio:9000"
        env.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
        assert storage.endpoint_of("s3://b/x", {}).startswith("AWS's own")
        assert storage.endpoint_of("s3://b/x", {"endpoint_url": "http://a"}) == "http://a"
        assert storage.endpoint_of("gs://b/x", {}) == ""
    assert sum(storage.RETRIES.values()) == retried


def test_a_bucket_dataset_missing_its_table_is_named_as_incomplete(capsys, s3_env, built,
                                                                   tmp_path):
    """A partial copy (an interrupted ``aws s3 sync``) without samples.parquet: the same
    message as for a local copy, at opening, from every command."""
    url = _upload(s3_env, {n: b for n, b in built.files.items() if n != "samples.parquet"},
                  "partial")
    with pytest.raises(DatasetError, match=rf"{url}: samples.parquet missing \(the dataset is "
                       r"incomplete\): restore it, or rebuild the dataset"):
        read_index(url)
    code, _, err = cli_main(capsys, "info", url)
    assert code == 1 and "samples.parquet missing (the dataset is incomplete)" in err, err
    # training opens it as a reader: the same, for the bucket and a local copy
    local = tmp_path / "partial"
    shutil.copytree(built.local, local)
    (local / "samples.parquet").unlink()
    shutil.rmtree(local / ".mimo-cache")
    for where in (url, str(local)):
        with pytest.raises(DatasetError, match="samples.parquet missing .the dataset is "
                           "incomplete"):
            ShardReader(where)


def test_a_missing_shard_object_is_a_dataset_error_naming_its_url(s3, built):
    url = _upload(s3, built.files, "gone")
    reader = ShardReader(url, storage_options=s3.storage_options)
    shard = built.samples[-1][0]
    _fs(s3).rm_file(f"{BUCKET}/gone/{shard}")
    with pytest.raises(DatasetError) as failed:
        reader.read_member(len(reader) - 1, "json")
    message = str(failed.value)
    assert f"{url}/{shard}: missing" in message
    assert f"mimo-shard verify {url}" in message
    reader.close()
    # a prefix (or bucket) with nothing under it: a typo, not an interrupted build; a bucket
    # that is not there is told from a prefix with nothing in it
    for typo, said in ((f"s3://{BUCKET}/gnoe", "nothing there, no such dataset \\(check the "
                        "prefix\\)"),
                       ("s3://mimo-no-such-bucket/gone", "its bucket does not exist at the "
                        "endpoint http://127\\.0\\.0\\.1:\\d+: check the URL and the endpoint")):
        with pytest.raises(DatasetError, match=f"^{typo}: {said}") as missing:
            ShardReader(typo, storage_options=s3.storage_options)
        assert missing.value.missing          # a usage error (exit 2), as a local typo's
    # a misspelt storage option (s3fs takes it, its session refuses it at the first request)
    from mimo_data.shards.storage import LocationError
    with pytest.raises(LocationError, match=r"the storage client takes no such option .*"
                       "'endpoint'.*check the storage options' keys"):
        storage.exists(url, {**s3.storage_options, "endpoint": "http://127.0.0.1:1"})


def test_shards_cut_short_or_missing_are_named_at_opening_and_not_retried(
        s3, built, tmp_path, monkeypatch):
    """A shard object cut to half its size and another deleted: the check every run makes as
    it opens its datasets (``DataSource``) names both, with the sizes, in the bucket and in a
    local copy; a read of the cut shard is a DatasetError saying so at once, not retried as a
    network fault. Credentials that may not read the bucket (S3's 403) are a StorageError
    naming the object and the credentials, not retried either."""
    from mimo_data.loading.loader import DataSource
    monkeypatch.setattr(storage, "BACKOFF_S", 0.01)
    shards = sorted({shard for shard, _, _ in built.samples})
    cut, gone = shards[-1], shards[0]
    files = {name: data[:len(data) // 2] if name == cut else data
             for name, data in built.files.items() if name != gone}
    local = tmp_path / "damaged"
    for name, data in files.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    url = _upload(s3, files, "cut-and-gone")
    config = preprocess_config_file(tmp_path / "preprocess.yaml")
    for dataset in (url, str(local)):
        with pytest.raises(DatasetError) as failed:
            DataSource([dataset], config, storage_options=s3.storage_options,
                       cache_dir=str(tmp_path / "cache"))
        message = str(failed.value)
        assert f"shard {gone} missing; {cut} holds {len(files[cut])} bytes, the index says " \
               f"{len(built.files[cut])}" in message, message
        assert f"mimo-shard verify {dataset}" in message, message
    reader = ShardReader(url, storage_options=s3.storage_options)
    retried = sum(storage.RETRIES.values())
    with pytest.raises(DatasetError, match=f"{url}/{cut} holds {len(files[cut])} bytes"):
        reader.read_member(len(reader) - 1, "json")
    assert sum(storage.RETRIES.values()) == retried
    s3.faults = Faults(rate=1.0, kinds=("403",))
    with pytest.raises(StorageError, match=f"reading {url}/{gone} bytes [0-9-]+ \\(endpoint "
                       f"{s3.endpoint_url}\\): access denied.*Check the credentials"):
        reader.read_member(0, "json")
    assert sum(storage.RETRIES.values()) == retried and s3.injected["403"] == 1
    reader.close()
    # shards in folders below the root (tars indexed in place where they lie): found there
    s3.faults = None
    fs = _fs(s3)
    fs.pipe_file(f"{BUCKET}/nested/a.tar", b"a" * 10)
    fs.pipe_file(f"{BUCKET}/nested/part/b.tar", b"b" * 20)
    remote = storage.Remote(f"s3://{BUCKET}/nested", s3.storage_options)
    names = ["a.tar", "part/b.tar", "c.tar"]
    listed = storage.look_up(f"s3://{BUCKET}/nested", names, remote)
    assert {name: size for name, (size, _) in listed.items()} == {"a.tar": 10, "part/b.tar": 20}
    # credentials that read objects but may not list them: each shard looked up instead, its
    # version (the ETag) the listing's
    s3.faults = Faults(rate=1.0, kinds=("403",), listings_only=True)
    s3.reset_counters()
    remote = storage.Remote(f"s3://{BUCKET}/nested", s3.storage_options)      # no listing kept
    assert storage.look_up(f"s3://{BUCKET}/nested", names, remote) == listed
    assert all(version.startswith("etag ") for _, version in listed.values()), listed
    assert s3.injected["403"] == 2 and s3.requests["HEAD"] >= 3, dict(s3.requests)


def test_a_shard_cut_short_after_the_start_up_check_is_named_at_once(s3, built, monkeypatch):
    """A shard cut short mid-run, after the start-up check listed the shards (s3fs keeps that
    listing): its read is the DatasetError saying so, at once, not six tries of a "network"
    fault (the object's size looked up again, not taken from the listing)."""
    monkeypatch.setattr(storage, "BACKOFF_S", 0.01)
    url = _upload(s3, built.files, "cut-mid-run")
    reader = ShardReader(url, storage_options=s3.storage_options)
    reader.check_shards()                               # the run's start-up check: intact
    shard = built.samples[-1][0]
    data = built.files[shard]
    _fs(s3).pipe_file(f"{BUCKET}/cut-mid-run/{shard}", data[:len(data) // 2])
    retried = sum(storage.RETRIES.values())
    with pytest.raises(DatasetError, match=f"{url}/{shard} holds {len(data) // 2} bytes"):
        reader.read_member(len(reader) - 1, "json")
    assert sum(storage.RETRIES.values()) == retried
    reader.close()


def test_a_cache_folder_that_cannot_be_made_is_named_with_its_setting(tmp_path, monkeypatch):
    """A remote dataset's tables are kept in the cache: a cache folder in the way of a file is
    a ConfigError naming the folder and the setting that named it."""
    from mimo_data.errors import ConfigError
    from mimo_data.shards.cache import cache_directory
    (tmp_path / "afile").write_text("in the way\n")
    root = tmp_path / "afile" / "cache"
    monkeypatch.setenv("MIMO_CACHE_DIR", str(root))
    with pytest.raises(ConfigError, match=f"s3://b/ds's tables cannot be kept: {root}/ds-.* "
                       f"cannot be made \\(Not a directory\\); MIMO_CACHE_DIR={root} must be a "
                       "folder this process can write to"):
        cache_directory("s3://b/ds")
    monkeypatch.delenv("MIMO_CACHE_DIR")
    with pytest.raises(ConfigError, match=f"; the cache folder {root} \\(data.cache_dir, or "
                       "--cache-dir\\) must be"):
        cache_directory("s3://b/ds", str(root))


def test_a_buckets_cache_folder_is_its_endpoints(tmp_path, monkeypatch):
    """Two S3-compatible stores (MinIO servers) may each hold a bucket of the same name: their
    tables and default index folders are apart; a bucket on AWS's own endpoint keeps the
    folder named by its URL alone."""
    import hashlib

    from mimo_data.shards.cache import external_directory, index_folder
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    aws = external_directory("s3://b/ds", str(tmp_path))
    assert aws == str(tmp_path / f"ds-{hashlib.sha256(b's3://b/ds').hexdigest()[:12]}")
    first, second = (external_directory("s3://b/ds", str(tmp_path), {"endpoint_url": url})
                     for url in ("http://minio-a:9000", "http://minio-b:9000"))
    assert len({aws, first, second}) == 3
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://minio-a:9000")     # the environment's
    assert external_directory("s3://b/ds", str(tmp_path)) == first
    assert index_folder(["s3://b/ds"]) != index_folder(["s3://b/ds"],
                                                       {"endpoint_url": "http://minio-b:9000"})


# ---------------------------------------------------------------------------------- inspect

def test_inspect_report_on_the_url_counts_what_the_local_copy_does(capsys, s3_env, built,
                                                                    tmp_path):
    from mimo_data.inspect.cli import main

    config = preprocess_config_file(tmp_path / "preprocess.yaml")
    reports = []
    for directory in (built.url, built.local):
        out = tmp_path / f"report-{len(reports)}.json"
        capsys.readouterr()
        code = main(["report", str(directory), "--config", str(config), "--json", str(out),
                     "--no-progress"])
        err = capsys.readouterr().err
        reports.append((code, json.loads(out.read_text()), err))
    (remote_code, remote, err), (local_code, local, _) = reports
    assert remote_code == local_code, err
    assert remote["samples"] == local["samples"] == len(built.samples)
    for field in ("kept", "dropped", "tokens", "drop_reasons", "modalities", "flagged"):
        assert remote[field] == local[field], field
    assert remote["dataset"] == built.url
    # a shard lost from the bucket: the report, the gate before a launch, fails as the run's
    # start-up would, its first time too (its tables not saved yet)
    shards = sorted({shard for shard, _, _ in built.samples})
    url = _upload(s3_env, {name: data for name, data in built.files.items()
                           if name != shards[0]}, "report-shard-lost")
    capsys.readouterr()
    code = main(["report", url, "--config", str(config), "--no-progress",
                 "--cache-dir", str(tmp_path / "lost-cache")])
    err = capsys.readouterr().err
    assert code == 1 and f"shard {shards[0]} missing" in err and \
        f"mimo-shard verify {url}" in err, err


def test_inspect_sample_says_why_a_bucket_build_skipped_the_record_asked_for(
        capsys, s3_env, built, tmp_path):
    """``sample --key`` of a record the build skipped: why, from the bucket's skipped.jsonl,
    as from a local folder's."""
    from mimo_data.inspect.cli import main

    entry = {"location": "in.jsonl:7", "reason": "missing_media", "id": "lost-photo",
             "detail": "media file photo.jpg: not found"}
    url = _upload(s3_env, {**built.files, "skipped.jsonl": (json.dumps(entry) + "\n").encode()},
                  "sample-skipped")
    config = preprocess_config_file(tmp_path / "preprocess.yaml")
    capsys.readouterr()
    code = main(["sample", url, "--config", str(config), "--key", "lost-photo",
                 "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert code == 2 and err.rstrip().endswith(
        ": the build skipped the record of id 'lost-photo' (in.jsonl:7: missing_media: media "
        "file photo.jpg: not found)"), err


# ----------------------------------------------------------------------------------- config

def test_train_config_redacts_storage_secrets_and_keeps_urls(tmp_path, monkeypatch):
    from mimo_train.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "train.yaml"
    path.write_text("data:\n"
                    "  datasets: [s3://bucket/ds, gs://other/set, shards]\n"
                    "  storage_options:\n"
                    "    key: AKIAEXAMPLEKEY\n"
                    "    secret: s3cr3t-value\n"
                    "    client_kwargs: {endpoint_url: 'http://x:9000', region_name: r1}\n")
    config = TrainConfig.load(str(path), ["data.valid=[s3://bucket/valid]",
                                          "train.eval_interval=10"])
    assert config.data.datasets == ["s3://bucket/ds", "gs://other/set",
                                    str(tmp_path / "conf" / "shards")]
    assert config.data.valid == ["s3://bucket/valid"]

    written = config.to_dict()
    options = written["data"]["storage_options"]
    text = json.dumps(written)
    assert "AKIAEXAMPLEKEY" not in text and "s3cr3t-value" not in text
    assert set(options) == {"key", "secret", "client_kwargs"}
    assert options["client_kwargs"] == {"endpoint_url": "http://x:9000", "region_name": "r1"}
    # the live config keeps what the reader needs
    assert config.data.storage_options["secret"] == "s3cr3t-value"
    assert TrainConfig.from_dict(written).data.datasets[:2] == ["s3://bucket/ds",
                                                                 "gs://other/set"]


# ------------------------------------------------------------------------------------- http

def test_a_dataset_served_over_http_reads_like_the_local_copy(capsys, built, fresh_cache,
                                                              monkeypatch):
    """HTTP has no listing: a dataset is read at an ``http://`` URL by ranged GETs, its tables
    downloaded from its ``.mimo-cache/``; ``info`` and ``verify`` agree with the local copy."""
    with LocalHTTP(built.local.parent) as http:
        url = f"{http.url}/{built.local.name}"
        capsys.readouterr()
        reader = ShardReader(url)
        assert "writing" not in capsys.readouterr().err             # no table was derived
        assert len(reader) == len(built.samples)
        published = {name for name in built.files if name.startswith(".mimo-cache/")}
        cached = {p.name: p.read_bytes() for p in fresh_cache.glob("*/*.arrow")}
        assert cached == {name.split("/")[-1]: built.files[name] for name in published}
        for name in published:                                      # downloaded from the server
            assert http.paths[f"GET /{built.local.name}/{name}"] >= 1, dict(http.paths)
        assert set(http.requests) <= {"GET", "HEAD"}, dict(http.paths)
        http.reset_counters()
        for position, (shard, key, members) in enumerate(built.samples):
            assert (reader.table.shard(position), reader.table.key(position)) == (shard, key)
            assert reader.record(position) == json.loads(members["json"])
        assert sum(http.requests.values()) == 0, dict(http.paths)    # records: no request
        reader.prefetch(range(len(reader)))
        for position, (_, key, members) in enumerate(built.samples):
            assert set(reader.table.members(position)) == set(members)
            for name, data in members.items():
                assert reader.read_member(position, name) == data, (key, name)
        shards = len(shard_paths(built.local))
        assert set(http.requests) == {"GET"}, dict(http.paths)
        assert all(path.endswith(".tar") for path in http.paths), dict(http.paths)
        assert http.requests["GET"] <= shards, dict(http.paths)          # one run per shard
        http.reset_counters()
        reader.check_shards()               # the start-up check: a HEAD per shard, sizes equal,
        assert http.requests == {"HEAD": shards, "GET": 1}, dict(http.paths)  # one range read
        reader.close()
        assert not storage.Remote(url).exists(f"{url}/no-such.tar")        # a 404: absent
        code, out, err = cli_main(capsys, "info", url, "--json")
        assert code == 0, err
        remote = json.loads(out)
        code, out, err = cli_main(capsys, "info", built.local, "--json")
        assert code == 0, err
        local = json.loads(out)
        assert remote.pop("directory") == url
        local.pop("directory")
        assert remote == local
        code, out, err = cli_main(capsys, "verify", url, "--no-progress")
        assert code == 0 and "OK" in out, err
        # a URL with a typo: said as such (no listing to say more), not as a build interrupted
        code, _, err = cli_main(capsys, "info", f"{url}-typo")
        assert code == 2 and f"{url}-typo: no index.json at {url}-typo/index.json: check the " \
            "URL" in err, err
        # a shard the server refuses (a signed URL expired): access denied, at once, short
        shard = shard_paths(built.local)[0].name
        http.denied.add(f"{built.local.name}/{shard}")
        for call, asked in ((lambda: storage.Remote(url).exists(f"{url}/{shard}"),
                             {"HEAD": 1, "GET": 1}),     # fsspec's look-up: a HEAD, a GET
                            (lambda: storage.Remote(url).read_range(f"{url}/{shard}", 512, 100),
                             {"GET": 1})):
            http.reset_counters()
            with pytest.raises(StorageError, match=r": access denied \(HTTP 403 Forbidden\): "
                               "the server refuses this URL") as caught:
                call()
            assert "RequestInfo" not in str(caught.value)
            assert http.requests == asked, dict(http.paths)                  # no retry
        http.denied.clear()
        # a shard cut short, read past its end (the server answers 416): said as cut short
        cut = built.local.parent / "cut-short"
        cut.mkdir()
        try:
            (cut / shard).write_bytes((built.local / shard).read_bytes()[:1000])
            with pytest.raises(storage.ShortObject, match=rf"{http.url}/cut-short/{shard} holds "
                               "1000 bytes, not the 5100 or more its dataset's index says"):
                storage.Remote(url).read_range(f"{http.url}/cut-short/{shard}", 5000, 100)
        finally:
            shutil.rmtree(cut)
        # a build into an HTTP URL: refused at once, no request made (HTTP is read here)
        http.reset_counters()
        code, _, err = cli_main(capsys, "build", str(CORPUS_DIR / INPUTS[0]), "-o",
                                f"{http.url}/new", "--no-progress")
        assert code == 2 and f"--output {http.url}/new: a dataset is read over HTTP, not " \
            "written" in err and sum(http.requests.values()) == 0, err
    # a server that ignores byte ranges (`python -m http.server`): said at once, not retried
    import functools
    import http.server
    import threading
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(built.local.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{built.local.name}"
        shard = shard_paths(built.local)[0].name
        retried = sum(storage.RETRIES.values())
        with pytest.raises(storage.RangesIgnored, match=r"bytes 512-612: \d+ bytes arrived "
                           "for 100: the server ignores byte ranges"):
            storage.Remote(url).read_range(f"{url}/{shard}", 512, 100)
        assert sum(storage.RETRIES.values()) == retried
        # found before a run reads (or mimo-inspect reports), and before an index is made of
        # its tars: one request, its reply not read
        with pytest.raises(storage.RangesIgnored, match=rf"reading {url}/{shard} bytes 1-2: the "
                           "whole object came: the server ignores byte ranges"):
            ShardReader(url).check_shards()
        code, _, err = cli_main(capsys, "index", f"{url}/{shard}", "-o", built.local.parent /
                                "http-index", "--no-progress")
        assert code == 2 and "the server ignores byte ranges (HTTP Range)" in err and not (
            built.local.parent / "http-index").exists(), err
    finally:
        server.shutdown()
        server.server_close()
    # no server: a fault, retried, never "missing" (fsspec's HTTP says FileNotFoundError)
    monkeypatch.setattr(storage, "ATTEMPTS", 2)
    monkeypatch.setattr(storage, "BACKOFF_S", 0.01)
    with pytest.raises(StorageError, match="looking up http://127.0.0.1:9/ds/x.tar: failed 2 "
                       "times, last with ConnectionError"):
        storage.Remote("http://127.0.0.1:9/ds").exists("http://127.0.0.1:9/ds/x.tar")
    # a server that takes the connection and never answers: each try ends at the timeout,
    # said as such (aiohttp's own default waits five minutes, its error text empty)
    import socket
    monkeypatch.setattr(storage, "HTTP_TIMEOUT_S", 0.3)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        stalled = f"http://127.0.0.1:{silent.getsockname()[1]}/ds"
        with pytest.raises(StorageError, match=rf"reading {stalled}/index.json: failed 2 times, "
                           "last with FSTimeoutError: no answer in time"):
            storage.Remote(stalled).read(f"{stalled}/index.json")


def test_a_failed_builds_shards_left_in_a_store_that_refuses_are_named_without_retrying_each(
        capsys):
    """Removing a failed build's uploads stops at the store's first refusal (an unreachable
    store would make each removal wait out its retries) and names what is left."""
    from types import SimpleNamespace

    from mimo_data.shards.build import _remove_uploaded
    tried = []

    def remove(url):
        tried.append(url)
        if len(tried) > 1:
            raise StorageError(f"{url}: the store cannot be reached")
    urls = [f"s3://b/ds/data-{n:06d}.tar" for n in range(5)]
    _remove_uploaded(SimpleNamespace(remove=remove), urls)
    assert tried == urls[:2]
    assert "the failed build's shards s3://b/ds/data-000001.tar, s3://b/ds/data-000002.tar, " \
        "s3://b/ds/data-000003.tar ... are left" in capsys.readouterr().err
