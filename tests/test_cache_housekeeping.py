"""``mimo-shard cache``: the tables derived from a dataset are listed with what they are, and the
superseded ones, and only those, are removed: tables of an earlier build of the dataset (rebuilt
in place), a token table replaced by a newer one for the same preprocessing (the code changed),
tables of an earlier mimo, damaged files and temporary files of interrupted writes. The current
tables stay and are still used without computing them again."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from conftest import CORPUS_DIR, build_dataset, cli_main, preprocess_config_file
from mimo_data.loading import token_table as tables
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.preprocessor import Preprocessor
from mimo_data.shards.reader import ShardReader


def _table(dataset: Path, config: Path, cache_dir: Path) -> tables.TokenTable:
    preprocessor = Preprocessor(PreprocessConfig.from_yaml(str(config)), with_media=False)
    return tables.token_table(ShardReader(str(dataset), str(cache_dir)), preprocessor,
                              cache_dir=str(cache_dir))


def _listing(capsys, dataset: Path, cache_dir: Path, *flags: str) -> dict:
    code, out, _ = cli_main(capsys, "cache", str(dataset), "--cache-dir",
                            str(cache_dir), "--json", *flags)
    assert code == 0
    return json.loads(out)


def _status(listing: dict) -> dict[str, tuple[str, bool]]:
    return {Path(f["path"]): (f["kind"], f["superseded"]) for f in listing["files"]}


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


@pytest.fixture
def caches(tmp_path, capsys, monkeypatch):
    """A dataset with an external cache holding every kind of file, current and superseded;
    name -> the file's path."""
    dataset, cache_dir = tmp_path / "shards", tmp_path / "cache"
    build_dataset([CORPUS_DIR / "llava.jsonl"], dataset)
    config = preprocess_config_file(tmp_path / "p.yaml")
    shorter = tmp_path / "p256.yaml"
    shorter.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()),
                                       "seq_length": 256}))
    replaced = Path(_table(dataset, config, cache_dir).path)
    _age(replaced, 600)
    monkeypatch.setattr(tables, "CODE", tables.CODE[:-1])      # as if the code had changed
    current = Path(_table(dataset, config, cache_dir).path)
    other = Path(_table(dataset, shorter, cache_dir).path)     # another preprocessing
    monkeypatch.undo()
    folder = current.parent
    earlier = folder / "tokens-0123456789abcdef01234567.arrow"  # no labels: an earlier mimo
    with pa.OSFile(str(earlier), "wb") as sink, \
            pa.ipc.new_file(sink, pa.schema([("tokens", pa.int32())])) as writer:
        writer.write_table(pa.table({"tokens": pa.array([1], pa.int32())}))
    damaged = folder / "tokens-fedcba9876543210fedcba98.arrow"
    damaged.write_bytes(b"not an arrow file")
    stale, fresh = folder / "tokens-x.arrow.tmp-old", folder / "tokens-y.arrow.tmp-new"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    _age(stale, 7200)
    return {"dataset": dataset, "cache_dir": cache_dir, "config": config, "replaced": replaced,
            "current": current, "other": other, "earlier": earlier, "damaged": damaged,
            "stale": stale, "fresh": fresh}


def test_lists_every_file_and_removes_only_the_superseded(caches, capsys):
    dataset, cache_dir = caches["dataset"], caches["cache_dir"]
    assert len({caches[n] for n in ("replaced", "current", "other")}) == 3
    status = _status(_listing(capsys, dataset, cache_dir))
    superseded = {caches[n] for n in ("replaced", "earlier", "damaged", "stale")}
    kept = {caches[n] for n in ("current", "other", "fresh")}
    samples = {path for path, (kind, _) in status.items() if kind == "samples"}
    records = {path for path, (kind, _) in status.items() if kind == "records"}
    assert {path for path, (_, gone) in status.items() if gone} == superseded
    assert {path for path, (_, gone) in status.items() if not gone} == kept | samples | records
    # the build writes the records table beside the dataset (remote readers download it)
    assert {path.parent.name for path in records} == {".mimo-cache"}
    assert status[caches["current"]][0] == status[caches["other"]][0] == "tokens"
    # the sample table the build wrote beside the dataset, read there: no copy derived into
    # the external cache
    assert {path.parent.name for path in samples} == {".mimo-cache"}

    listing = _listing(capsys, dataset, cache_dir, "--remove")
    assert listing["removed_bytes"] == sum(f["size"] for f in listing["files"]
                                           if f["superseded"])
    remaining = {p for p in cache_dir.rglob("*") if p.is_file()}
    assert not remaining & superseded and kept <= remaining
    assert not any(gone for _, gone in _status(_listing(capsys, dataset, cache_dir)).values())


def test_the_current_tables_are_still_used(caches, capsys, monkeypatch):
    _listing(capsys, caches["dataset"], caches["cache_dir"], "--remove")
    computed = []
    monkeypatch.setattr(tables, "compute", lambda *a, **k: computed.append(a) or None)
    monkeypatch.setattr(tables, "CODE", tables.CODE[:-1])
    table = _table(caches["dataset"], caches["config"], caches["cache_dir"])
    assert Path(table.path) == caches["current"] and computed == []


def test_a_rebuilt_dataset_supersedes_what_was_derived_from_it(caches, capsys):
    dataset, cache_dir = caches["dataset"], caches["cache_dir"]
    build_dataset([CORPUS_DIR / "llava.json"], dataset, overwrite=True)   # other samples
    status = _status(_listing(capsys, dataset, cache_dir))
    for name in ("current", "other"):
        assert status[caches[name]] == ("tokens", True)
    # the new build's sample table (the build writes it beside the dataset) is current
    assert sorted((path.parent.name == ".mimo-cache", gone) for path, (kind, gone)
                  in status.items() if kind == "samples") == [(True, False)]


def test_the_text_listing_says_why(caches, capsys):
    code, out, _ = cli_main(capsys, "cache", str(caches["dataset"]),
                            "--cache-dir", str(caches["cache_dir"]))
    assert code == 0
    assert "a newer table replaced it" in out and "an interrupted write" in out
    assert "an earlier mimo" in out and "unreadable" in out
    assert "seq_length 256" in out
    assert "4 superseded" in out and "--remove deletes them" in out
    # a --cache-dir mistyped (not there, or a file): said, not "0 superseded" of the dataset's
    for wrong, said in ((caches["cache_dir"].parent / "no-such-cache", "is not there"),
                        (caches["current"], "is a file")):
        code, _, err = cli_main(capsys, "cache", str(caches["dataset"]), "--cache-dir",
                                str(wrong))
        assert code == 2 and f"--cache-dir {wrong} {said}: give the cache folder" in err, err


def test_inspect_and_training_share_a_cache_dir(tmp_path, capsys, monkeypatch):
    """``mimo-inspect report --cache-dir C`` saves the token table training reads from
    ``data.cache_dir: C``: training then computes nothing, and the cache listing shows it."""
    from mimo_data.inspect.cli import main as inspect_main

    dataset, cache_dir = tmp_path / "shards", tmp_path / "cache"
    build_dataset([CORPUS_DIR / "llava.jsonl"], dataset)
    config = preprocess_config_file(tmp_path / "p.yaml")
    assert inspect_main(["report", str(dataset), "--config", str(config), "--cache-dir",
                         str(cache_dir), "--no-progress"]) == 0
    saved = sorted(cache_dir.rglob("tokens-*.arrow"))
    assert len(saved) == 1 and not list(dataset.rglob("tokens-*.arrow"))
    monkeypatch.setattr(tables, "compute", lambda *a, **k: pytest.fail("computed again"))
    assert Path(_table(dataset, config, cache_dir).path) == saved[0]
    capsys.readouterr()
    status = _status(_listing(capsys, dataset, cache_dir))
    assert status[saved[0]] == ("tokens", False)
    # the build's sample and records tables (beside the dataset, read there), the report's
    # and the token table (in the cache)
    assert sorted(kind for kind, _ in status.values()) == ["records", "report", "samples",
                                                           "tokens"]
