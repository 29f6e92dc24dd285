"""Shared fixtures: the sample corpus read independently of mimo_data, built datasets, the
models set-up made, and the session's parent of forked ranks (``ranks``: tests/support/launch.py).

Everything here reads the sample corpus (``assets/corpus``, built by ``tools/setup.sh``) with
json / pyarrow / Pillow / soundfile directly, never through ``mimo_data``: the tests compare
what ``mimo-shard build`` wrote against these independent readings of the inputs.
"""

from __future__ import annotations

import ast
import io
import json
import multiprocessing.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from support import launch

REPO = Path(__file__).resolve().parents[1]
CORPUS_DIR = REPO / "assets" / "corpus"
MODELS = REPO / "assets" / "models"
# each Qwen-family tower kind's published checkpoint: MODELS / "published" / NAME is its
# replica (dims shrunk), REPO / "tools" / "published" / NAME its config as published
PUBLISHED_TOWERS = {"qwen2_vl": "Qwen--Qwen2-VL-2B-Instruct",
                    "qwen2_5_vl": "Qwen--Qwen2.5-VL-3B-Instruct",
                    "qwen3_vl": "Qwen--Qwen3-VL-2B-Instruct",
                    "qwen3_vl_moe": "Qwen--Qwen3-VL-30B-A3B-Instruct",
                    "qwen3_5": "Qwen--Qwen3.5-4B", "qwen3_5_moe": "Qwen--Qwen3.5-35B-A3B"}

# The five inputs of the sample corpus, in the order the tests pass them to a build.
CORPUS_INPUTS = ("llava.json", "llava.jsonl", "conversations.parquet", "speech.parquet",
                 "speech_manifest.jsonl")
DEFAULT_INSTRUCTION = "Transcribe the audio."

# ShareGPT speaker names -> stored roles (the stored roles are system/user/assistant).
SPEAKER_ROLE = {"human": "user", "gpt": "assistant", "system": "system",
                "user": "user", "assistant": "assistant"}


# The files that take longest, collected first: the two xdist workers of ``make test`` take
# whole files in collection order, and a long file started last would run alone at the end.
# What takes long is a job (forked ranks, torchrun, a fresh interpreter), so a file's weight is
# the number of jobs it launches, read from the code (``launches``): each of its tests that
# launches one (each parametrization), each of its own fixtures that does (once). A function
# launches when it calls ``ranks.run``, ``torchrun``, ``python`` or ``session`` of
# ``support.launch``, or a function that does (in ``support/`` or in the test file itself).
LAUNCHERS = frozenset({"torchrun", "python", "session"})
SUPPORT = frozenset({"launch", "runs", "vlm_runs", "anomaly_runs"})     # tests/support/


def launches(tree: ast.Module, known: frozenset[str] = LAUNCHERS) -> frozenset[str]:
    """The module-level functions of ``tree`` that launch a job, given the names ``known`` to
    (fixed point: a function calling one of them launches too)."""
    found = set(known)
    while True:
        more = {node.name for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name not in found
                and any(_launch_call(call, found - {a.arg for a in node.args.args})
                        for call in ast.walk(node) if isinstance(call, ast.Call))}
        if not more:
            return frozenset(found)
        found |= more


def _launch_call(call: ast.Call, found: set[str]) -> bool:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in found
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        on = func.value.id           # ranks.run(...), or a support module's: runs.step(...)
        return (func.attr == "run" and on in ("ranks", "parent")) or \
            (on in SUPPORT and func.attr in found)
    return False


def _support_launchers() -> frozenset[str]:
    found = LAUNCHERS
    for _ in range(3):             # support modules call each other (vlm_runs -> runs)
        for path in sorted((Path(__file__).parent / "support").glob("*.py")):
            found = found | launches(ast.parse(path.read_text()), found)
    return found


def pytest_collection_modifyitems(items) -> None:
    support = _support_launchers()
    weights: dict[Path, int] = {}
    trees: dict[Path, tuple[frozenset[str], set[str]]] = {}
    fixtures_used: dict[Path, set[tuple]] = {}
    for item in items:
        path = item.path
        if path not in trees:
            tree = ast.parse(path.read_text())
            fixtures = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                        and any("fixture" in ast.unparse(d) for d in node.decorator_list)}
            trees[path] = (launches(tree, support), fixtures)
            weights[path], fixtures_used[path] = 0, set()
        launching, fixtures = trees[path]
        name = getattr(item, "originalname", item.name)
        weights[path] += name in launching
        # a fixture's instance: one per value of the parametrized fixtures the test gets
        params = getattr(item, "callspec", None)
        instance = tuple(sorted((k, repr(v)) for k, v in params.params.items()
                                if k in item.fixturenames)) if params else ()
        fixtures_used[path] |= {(f, instance) for f in
                                set(item.fixturenames) & fixtures & launching}
    for path, used in fixtures_used.items():
        weights[path] += len(used)
    items.sort(key=lambda item: -weights[item.path])        # stable: file order otherwise


# ------------------------------------------------------------ what the suite leaves behind
# The process that starts the run (pytest itself, or the xdist controller; not a worker) is the
# reaper of every process the suite starts whose parent ends first (``launch.adopt_orphans``),
# and everything the suite starts writes its temporary files in pytest's own folder (TMPDIR,
# W&B's folders): at the end of the run nothing may be left, or the run fails.

# how long processes that are ending by themselves (a worker's forkserver once the worker has
# gone) get, at the end of the run, before those left are killed and reported: they end in
# milliseconds; what never ends (a leftover) is reported whatever the wait
LEFTOVER_GRACE_S = 60.0
WANDB_DIRS = ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")


def _starts_the_run(config) -> bool:
    return not hasattr(config, "workerinput")          # not an xdist worker


@pytest.hookimpl(trylast=True)                     # after the tmp_path plugin's configure
def pytest_configure(config) -> None:
    if not _starts_the_run(config):                 # a worker inherits the controller's set-up
        return
    launch.adopt_orphans()
    # multiprocessing's folder (its forkserver's socket) is removed at this process's exit,
    # after a passed run has removed pytest's: made first, it lies in the system's
    multiprocessing.util.get_temp_dir()
    folder = config._tmp_path_factory.getbasetemp() / "tmp"
    folder.mkdir(exist_ok=True)
    # wandb creates folders in the temporary directory at import (megatron-core imports it),
    # which a forked rank's os._exit never removes; its core writes logs under ~/.cache
    os.environ["TMPDIR"] = str(folder)
    os.environ.update({name: str(folder / name.lower()) for name in WANDB_DIRS})
    # as every mimo command runs (mimo_data.hub.cache_only): the same hub reads in every test,
    # not from whichever test first calls a command in-process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tempfile.tempdir = None                         # read TMPDIR again


def _multiprocessing_helpers() -> tuple[int, ...]:
    """This process's forkserver and resource tracker, if started: they end with it (each
    waits for the end of a pipe this process holds)."""
    from multiprocessing import forkserver, resource_tracker
    pids = (getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None))
    return tuple(pid for pid in pids if pid)


@pytest.hookimpl(trylast=True)                     # after xdist has ended its workers
def pytest_sessionfinish(session) -> None:
    """Every process the suite started has ended, or the run fails: those still alive (after
    ``LEFTOVER_GRACE_S`` for any that is ending) are killed and named."""
    if not _starts_the_run(session.config):
        return
    spare = _multiprocessing_helpers()
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while time.monotonic() < deadline and any(
            state != "Z" for pid, state in launch.children().items() if pid not in spare):
        time.sleep(0.1)
    left = launch.end_children(spare)
    if not left:
        return
    title = f"{len(left)} processes the suite started outlived it (killed now)"
    lines = [f"{pid}: {command}" for pid, command in sorted(left.items())]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        print("\n".join([title, *lines]), file=sys.stderr)
    else:
        reporter.ensure_newline()
        reporter.write_sep("=", title, red=True)
        for line in lines:
            reporter.write_line(line, red=True)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@contextmanager
def scratch(tmp_path_factory, name: str) -> Iterator[Path]:
    """A module fixture's folder, removed when the module is done with it: a run of the real
    language model writes GBs of checkpoints, and the suite's disk is shared."""
    path = tmp_path_factory.mktemp(name)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def ranks():
    """The session's parent of forked ranks (``launch.Ranks``): torch, transformers and
    megatron-core imported once, every multi-rank job forked from it. It ends with this
    process, and ends the job in progress with it (tests/support/launch.py)."""
    parent = launch.Ranks()
    yield parent
    parent.close()


def symbolic_sizes(graph) -> set[int]:
    """The dimensions of a dynamo graph's (``torch.fx.GraphModule``) input tensors whose size
    is symbolic (dynamic)."""
    import torch
    return {dim for node in graph.graph.nodes if node.op == "placeholder"
            and isinstance(value := node.meta.get("example_value"), torch.Tensor)
            for dim, size in enumerate(value.shape) if not isinstance(size, int)}


def model_dir(name: str) -> Path:
    """A checkpoint directory built by tools/setup.sh; fails (not skips) when missing."""
    path = MODELS / name
    if not (path / ".complete").is_file():
        pytest.fail(f"{path} is missing or incomplete: run tools/setup.sh", pytrace=False)
    return path


@pytest.fixture(scope="session")
def local_s3():
    """The suite's local S3 server (tools/object_store.py), started once. moto's buckets are
    process-wide: each module makes a bucket of its own."""
    from tools.object_store import LocalS3
    with LocalS3() as s3:
        yield s3


@pytest.fixture
def s3(local_s3):
    """The local S3 with no faults, no added latency and its request counters at zero."""
    local_s3.faults, local_s3.latency_s = None, 0.0
    local_s3.reset_counters()
    yield local_s3
    local_s3.faults, local_s3.latency_s = None, 0.0


# ----------------------------------------------------------------------------------- corpus

@pytest.fixture(scope="session")
def corpus() -> Path:
    """The real sample corpus; fails (not skips) when it has not been built."""
    if not (CORPUS_DIR / ".complete").is_file():
        pytest.fail(f"the sample corpus {CORPUS_DIR} is missing or incomplete (no .complete "
                    "marker): run tools/setup.sh", pytrace=False)
    return CORPUS_DIR


@pytest.fixture(scope="session")
def corpus_photos(corpus) -> list[tuple]:
    """Every corpus image: (name, bytes, shard metadata, the reference processors' input).

    The reference input is Pillow's own EXIF transpose of the file in its stored mode, so a
    transformers processor does its own RGB conversion (``convert_to_rgb``) too.
    """
    from PIL import Image, ImageOps

    from mimo_data.modalities.image import probe_image
    entries = []
    for path in sorted((corpus / "images").iterdir()):
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as opened:
            reference = ImageOps.exif_transpose(opened)
            reference.load()
        entries.append((path.name, data, probe_image(data), reference))
    return entries


@dataclass(frozen=True)
class VideoClip:
    """A corpus clip: its bytes and its entry of ``videos/catalog.json`` (what was written;
    ``width``/``height`` as displayed, after ``rotation``; ``frames`` before any cut)."""
    name: str
    path: str
    data: bytes
    format: str
    codec: str
    fps: int
    frames: int
    width: int
    height: int
    rotation: int
    has_audio: bool
    truncated: bool


@pytest.fixture(scope="session")
def corpus_videos(corpus) -> dict[str, VideoClip]:
    """The corpus clips by name, from the catalog ``tools/make_video_clips.py`` wrote."""
    catalog = json.loads((corpus / "videos" / "catalog.json").read_text())
    fields = set(VideoClip.__dataclass_fields__) - {"data"}
    return {e["name"]: VideoClip(data=(corpus / e["path"]).read_bytes(),
                                 **{k: v for k, v in e.items() if k in fields})
            for e in catalog}


@pytest.fixture(scope="session")
def corpus_inputs(corpus) -> list[str]:
    """Absolute paths of all corpus input files."""
    return [str(corpus / name) for name in CORPUS_INPUTS]


@dataclass
class Expected:
    """One input record as the tests read it themselves."""
    file: str                 # absolute input path (as passed to the build)
    kind: str                 # "line" | "index" | "row"
    number: int
    id: str | None
    messages: list[dict]
    images: list[bytes] = field(default_factory=list)
    audios: list[bytes] = field(default_factory=list)

    @property
    def origin(self) -> tuple:
        return (self.file, self.kind, self.number)


def expected_messages(turns) -> list[dict]:
    """ShareGPT (from/value) or chat (role/content) turns in the stored form."""
    return [{"role": SPEAKER_ROLE[t["from"] if "from" in t else t["role"]],
             "content": t["value"] if "value" in t else t["content"]} for t in turns]


def _listed(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _conversation_record(path: str, kind: str, number: int, record: dict, root: Path) -> Expected:
    turns = record.get("conversations", record.get("messages"))
    images = _listed(record.get("images", record.get("image")))
    audios = _listed(record.get("audios", record.get("audio")))
    return Expected(path, kind, number, record.get("id"), expected_messages(turns),
                    [(root / p).read_bytes() for p in images],
                    [(root / p).read_bytes() for p in audios])


def _struct_bytes(item, root: Path) -> bytes:
    if isinstance(item, dict):
        return item["bytes"] if item.get("bytes") else (root / item["path"]).read_bytes()
    return (root / item).read_bytes()


def read_expected(path: str, instruction: str = DEFAULT_INSTRUCTION) -> list[Expected]:
    """The records of one input file (JSON, JSONL, Parquet or speech manifest)."""
    root = Path(path).parent
    records = []
    if path.endswith(".parquet"):
        table = pq.read_table(path).to_pylist()
        for row, record in enumerate(table):
            turns = record.get("messages", record.get("conversations"))
            if isinstance(turns, str):
                turns = json.loads(turns)
            images = _listed(record.get("images", record.get("image")))
            audios = _listed(record.get("audios", record.get("audio")))
            records.append(Expected(path, "row", row, record.get("id"), expected_messages(turns),
                                    [_struct_bytes(i, root) for i in images],
                                    [_struct_bytes(a, root) for a in audios]))
    elif path.endswith(".json"):
        for index, record in enumerate(json.loads(Path(path).read_text("utf-8"))):
            records.append(_conversation_record(path, "index", index, record, root))
    else:
        for number, line in enumerate(Path(path).read_text("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "audio_filepath" in record:
                records.append(Expected(
                    path, "line", number, record.get("id"),
                    [{"role": "user", "content": f"<audio>\n{instruction}"},
                     {"role": "assistant", "content": record["text"]}],
                    [], [(root / record["audio_filepath"]).read_bytes()]))
            else:
                records.append(_conversation_record(path, "line", number, record, root))
    return records


@pytest.fixture(scope="session")
def corpus_expected(corpus_inputs) -> list[Expected]:
    """Every record of the corpus, read independently of mimo_data."""
    return [record for path in corpus_inputs for record in read_expected(path)]


# ---------------------------------------------------------------------------- built output

def build_dataset(inputs, output, **options) -> dict:
    """``build()`` in this process (``workers=0``: no fork of the test process) unless told."""
    from mimo_data.shards.build import BuildOptions, build

    options = {"progress": False, "workers": 0, **options}
    return build([str(i) for i in inputs], str(output), BuildOptions(**options))


@pytest.fixture(scope="session")
def corpus_build(tmp_path_factory, corpus_inputs) -> Path:
    """The whole corpus built once, in-process, with default options."""
    out = tmp_path_factory.mktemp("corpus-build") / "dataset"
    build_dataset(corpus_inputs, out)
    return out


def read_json(path) -> dict:
    return json.loads(Path(path).read_bytes())


def shard_paths(directory) -> list[Path]:
    """The shard tars in a dataset directory, by name (not from the index)."""
    return sorted(Path(directory).glob("*.tar"))


def tar_samples(path) -> list[tuple[str, dict[str, bytes]]]:
    """``[(key, {suffix: bytes})]`` of one tar, in member order, read with ``tarfile``."""
    samples: list[tuple[str, dict[str, bytes]]] = []
    with tarfile.open(path) as tar:
        for info in tar:
            key, _, suffix = info.name.partition(".")
            if not samples or samples[-1][0] != key:
                samples.append((key, {}))
            samples[-1][1][suffix] = tar.extractfile(info).read()
    return samples


def write_tar(path: Path, members: dict[str, bytes], append: bool = False) -> Path:
    """A tar at ``path`` (its folder made) holding ``members`` (name -> bytes), in order;
    ``append``: added after the tar's members (``tar rf``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "a" if append else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def all_samples(directory) -> list[tuple[str, str, dict[str, bytes]]]:
    """``[(shard name, key, members)]`` over all shards of a dataset."""
    return [(path.name, key, members) for path in shard_paths(directory)
            for key, members in tar_samples(path)]


def sample_records(directory) -> list[dict]:
    """The decoded ``KEY.json`` of every sample, in shard/key order."""
    return [json.loads(members["json"]) for _, _, members in all_samples(directory)]


def samples_table(directory) -> list[dict]:
    return pq.read_table(Path(directory) / "samples.parquet").to_pylist()


def origin_of(sample: dict) -> tuple:
    """``(file, kind, number)`` of a sample's ``source`` (kind: line, index or row)."""
    source = sample["source"]
    kind = next(k for k in ("line", "index", "row") if k in source)
    return (source["file"], kind, source[kind])


def marker_modalities(messages: list[dict]) -> list[str]:
    """Modalities of the <image>/<audio>/<video> markers in reading order."""
    return [m.group(1) for message in messages
            for m in re.finditer(r"<(image|audio|video)>", message["content"])]


# ------------------------------------------------------------------------ writing inputs

def write_jsonl(path, records) -> Path:
    """One record per line; a ``bytes`` item is written as is (for malformed lines)."""
    path = Path(path)
    with open(path, "wb") as out:
        for record in records:
            line = record if isinstance(record, bytes) else json.dumps(record).encode()
            out.write(line.rstrip(b"\n") + b"\n")
    return path


def write_json(path, records) -> Path:
    path = Path(path)
    path.write_text(json.dumps(records, indent=1))
    return path


def chat(user: str, answer: str) -> list[dict]:
    """ShareGPT turns of one question and its answer."""
    return [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]


@pytest.fixture(scope="session")
def assets(corpus):
    """Real media files of the corpus, picked by what they are (not by hard-coded names)."""
    from PIL import Image

    jpegs, pngs = [], []
    for path in sorted((corpus / "images").iterdir()):
        with Image.open(path) as image:
            entry = (path, image.width * image.height)
            kind = jpegs if image.format == "JPEG" else pngs if image.format == "PNG" else []
            kind.append(entry)
    wavs = sorted((corpus / "audio").glob("*.wav"))
    flacs = sorted((corpus / "audio").glob("*.flac"))
    assert jpegs and pngs and wavs and flacs, "the corpus needs JPEG, PNG, WAV and FLAC files"
    return {
        "jpeg": min(jpegs, key=lambda e: e[1])[0],      # smallest photo: fast to probe
        "jpeg_large": max(jpegs, key=lambda e: e[1])[0],
        "png": min(pngs, key=lambda e: e[1])[0],
        "wav": wavs[0],
        "flac": flacs[0],
    }


@pytest.fixture
def good_records(assets):
    """Three valid records (image, audio, text-only) with absolute media paths: ids good-1..3."""
    return [
        {"id": "good-1", "image": str(assets["jpeg"]),
         "conversations": chat("<image>\nDescribe the image.", "A photo.")},
        {"id": "good-2", "audio": str(assets["flac"]),
         "conversations": chat("<audio>\nTranscribe the audio.", "Some words.")},
        {"id": "good-3", "conversations": chat("What is a tar file?", "An archive.")},
    ]


# --------------------------------------------------------------------------------- running

def mimo_shard_command() -> list[str]:
    """The installed console script, or the module when the script is not beside Python."""
    script = Path(sys.executable).parent / "mimo-shard"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mimo_data.shards.cli"]


def run_cli(*args, check_rc: int | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run ``mimo-shard ARGS`` in a subprocess, capturing text output."""
    result = subprocess.run([*mimo_shard_command(), *map(str, args)], capture_output=True,
                            text=True, timeout=300, **kwargs)
    if check_rc is not None:
        assert result.returncode == check_rc, (
            f"mimo-shard {' '.join(map(str, args))} exited {result.returncode}, "
            f"expected {check_rc}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def cli_main(capsys, *args) -> tuple[int, str, str]:
    """Run the CLI entry point in-process: ``(exit code, stdout, stderr)``.

    A build gets ``--workers 0`` unless told otherwise: no fork of the (threaded) test process.
    """
    from mimo_data.shards.cli import main

    argv = [str(a) for a in args]
    if argv[0] == "build" and "--workers" not in argv:
        argv += ["--workers", "0"]
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def flip_byte(path, offset: int) -> None:
    """Invert one byte of a file in place."""
    with open(path, "r+b") as data:
        data.seek(offset)
        byte = data.read(1)
        data.seek(offset)
        data.write(bytes([byte[0] ^ 0xFF]))


def rewrite_samples_parquet(directory: Path, table) -> None:
    """Replace ``directory``'s samples.parquet by ``table`` as a build that wrote it would have:
    index.json records its new sha256 and size, and the sample table of the new key is
    written beside the dataset."""
    from mimo_data.shards import sample_table
    from mimo_data.files import file_sha256, write_atomic
    from mimo_data.shards.index import dumps, read_index

    parquet = directory / "samples.parquet"
    pq.write_table(table, parquet)
    index = read_index(str(directory))
    index["files"]["samples.parquet"] = {"bytes": parquet.stat().st_size,
                                         "sha256": file_sha256(str(parquet))}
    write_atomic(str(directory / "index.json"), dumps(index))
    sample_table.write(str(parquet), str(directory / ".mimo-cache"),
                       sample_table.table_key(index, str(directory)))


def rerecord_member(directory: Path, key: str, name: str) -> None:
    """Record the crc32 of member ``name`` of sample ``key`` as its shard holds it now: the
    member then reads as the build had written it (a record a builder wrote that way, or media
    already damaged in the source of a ``--check header`` build)."""
    import zlib

    import pyarrow as pa

    table = pq.read_table(directory / "samples.parquet")
    rows = table.to_pylist()
    row = next(row for row in rows if row["key"] == key)
    member = next(m for m in row["members"] if m["name"] == name)
    with open(directory / row["shard"], "rb") as shard:
        shard.seek(member["offset"])
        member["crc32"] = zlib.crc32(shard.read(member["size"]))
    rewrite_samples_parquet(directory, pa.Table.from_pylist(rows, schema=table.schema))


def file_bytes(directory) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file under a directory."""
    directory = Path(directory)
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def image_size_after_exif(data: bytes) -> tuple[int, int, str]:
    """(width, height, mode) of an encoded image as Pillow shows it after EXIF orientation."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as image:
        shown = ImageOps.exif_transpose(image)
        return shown.width, shown.height, shown.mode


# --------------------------------------------------------------------------------- loader

@pytest.fixture(scope="session")
def loader_corpus(tmp_path_factory, corpus_inputs) -> Path:
    """The whole corpus built once in shards of 16 samples (several shards, blocks, windows)."""
    out = tmp_path_factory.mktemp("loader-corpus") / "shards"
    build_dataset(corpus_inputs, out, max_samples_per_shard=16)
    return out


def preprocess_config_file(path, **modalities) -> Path:
    """A preprocessing YAML with the corpus tokenizer and the given ``modalities`` section
    (e.g. ``image={"policy": "fixed", "image_size": 224}``); no modalities: the default file."""
    import yaml

    data = yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())
    data["tokenizer"] = str(REPO / "assets" / "tokenizer" / "smollm2")
    if modalities:
        data["modalities"] = modalities
    Path(path).write_text(yaml.safe_dump(data))
    return Path(path)
