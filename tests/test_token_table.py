"""The token table is computed once per (dataset, preprocessing) and reused; any change to what
it depends on (tokenizer files, chat template, preprocessing config, dataset) makes a new one;
a truncated or altered file is computed again, never used; concurrent builders leave one valid
table. (Ranks computing parts of it: tests/test_loader_dist.py.)"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from conftest import REPO, preprocess_config_file, write_tar
from mimo_data.loading import token_table as tables
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.preprocessor import Preprocessor
from mimo_data.shards import cache
from mimo_data.shards.reader import ShardReader


@pytest.fixture(scope="module")
def dataset(loader_corpus) -> Path:
    """The session's corpus in shards of 16 (conftest.py), not a build of its own: the token
    tables counted here are in each test's own cache directory, never the dataset's (where
    the readers without one, here as in other modules, keep its sample table)."""
    return loader_corpus


@pytest.fixture
def computes(monkeypatch) -> list:
    """Records every computation of a table (by dataset directory)."""
    calls: list = []
    original = tables.compute

    def counting(reader, *args, **kwargs):
        calls.append(reader.directory)
        return original(reader, *args, **kwargs)
    monkeypatch.setattr(tables, "compute", counting)
    return calls


def open_table(dataset: Path, config: Path, cache_dir: Path) -> tables.TokenTable:
    preprocessor = Preprocessor(PreprocessConfig.from_yaml(str(config)), with_media=False)
    return tables.token_table(ShardReader(str(dataset), str(cache_dir)), preprocessor,
                              cache_dir=str(cache_dir))


def table_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.rglob("tokens-*.arrow"))


def columns(table: tables.TokenTable) -> dict:
    return {"drop": table.drop.copy(), "tokens": table.tokens.copy(),
            "trained": table.trained.copy(),
            **{m: (o.copy(), v.copy()) for m, (o, v) in table.item_tokens.items()}}


def test_computed_once_then_reused(dataset, tmp_path, computes):
    config = preprocess_config_file(tmp_path / "p.yaml")
    first = columns(open_table(dataset, config, tmp_path / "cache"))
    assert computes == [str(dataset)] and len(table_files(tmp_path / "cache")) == 1
    again = open_table(dataset, config, tmp_path / "cache")
    assert computes == [str(dataset)]                                # read, not computed
    assert np.array_equal(again.tokens, first["tokens"]) and again.kept.sum() > 0
    # what the preprocessor says of every sample, sample by sample
    preprocessor = Preprocessor(PreprocessConfig.from_yaml(str(config)), with_media=False)
    reader = ShardReader(str(dataset))
    texts = preprocessor.text_batch([reader.record(p) for p in range(len(reader))])
    for position, text in enumerate(texts):
        if hasattr(text, "reason"):
            assert again.reasons[again.drop[position] - 1] == text.reason
        else:
            assert again.drop[position] == 0
            assert again.tokens[position] == len(text.ids) - 1
            assert again.trained[position] == text.loss_mask.sum()
            for modality, counts in text.token_counts.items():
                offsets, values = again.item_tokens[modality]
                assert list(values[offsets[position]:offsets[position + 1]]) == counts


def _tokenizer_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "tokenizer"
    shutil.copytree(REPO / "assets" / "tokenizer" / "smollm2", copy)
    return copy


def _with(config: Path, **changes) -> Path:
    data = yaml.safe_load(config.read_text())
    data.update(changes)
    config.write_text(yaml.safe_dump(data))
    return config


def _change_tokenizer(tmp_path, dataset, config):
    settings = tmp_path / "tokenizer" / "tokenizer_config.json"
    data = json.loads(settings.read_text())
    data["model_max_length"] = 12345
    settings.write_text(json.dumps(data))
    return dataset, config


def _change_template(tmp_path, dataset, config):
    template = tmp_path / "template.jinja"
    template.write_text("{#- another comment -#}\n" + template.read_text())
    return dataset, config


def _change_config(tmp_path, dataset, config):
    return dataset, _with(config, seq_length=512)


def _change_dataset(tmp_path, dataset, config):
    rebuilt = tmp_path / "rebuilt"
    shutil.copytree(dataset, rebuilt)
    index = json.loads((rebuilt / "index.json").read_text())
    index["build"]["seed"] = 7          # another build of the same records
    (rebuilt / "index.json").write_text(json.dumps(index))
    return rebuilt, config


@pytest.mark.parametrize("change", [_change_tokenizer, _change_template, _change_config,
                                    _change_dataset],
                         ids=["tokenizer-files", "chat-template", "preprocess-config",
                              "dataset"])
def test_a_change_to_what_it_depends_on_makes_a_new_table(dataset, tmp_path, computes,
                                                          change):
    tokenizer = _tokenizer_copy(tmp_path)
    template = tmp_path / "template.jinja"
    template.write_text((tokenizer / "chat_template.jinja").read_text())
    config = _with(preprocess_config_file(tmp_path / "p.yaml"), tokenizer=str(tokenizer),
                   chat_template=str(template))
    cache_dir = tmp_path / "cache"
    open_table(dataset, config, cache_dir)
    open_table(dataset, config, cache_dir)
    assert len(computes) == 1
    changed_dataset, changed_config = change(tmp_path, dataset, config)
    open_table(changed_dataset, changed_config, cache_dir)
    assert len(computes) == 2, "a table computed under the old inputs was used"
    assert len(table_files(cache_dir)) == 2


def _column_bytes_in_file(path: Path, values: np.ndarray) -> int:
    data = path.read_bytes()
    found = data.find(values.tobytes())
    assert found >= 0 and data.find(values.tobytes(), found + 1) < 0
    return found


@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_a_damaged_table_is_computed_again_never_used(dataset, tmp_path, computes, damage):
    config = preprocess_config_file(tmp_path / "p.yaml")
    cache_dir = tmp_path / "cache"
    original = columns(open_table(dataset, config, cache_dir))
    [path] = table_files(cache_dir)
    if damage == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    else:       # one token count changed: the file still opens as Arrow
        at = _column_bytes_in_file(path, original["tokens"])
        data = bytearray(path.read_bytes())
        data[at] ^= 0x01
        path.write_bytes(bytes(data))
        opened = pa.ipc.open_file(pa.memory_map(str(path))).read_all()   # still a table
        assert opened.column("tokens").to_numpy().tolist() != original["tokens"].tolist()
    again = open_table(dataset, config, cache_dir)
    assert len(computes) == 2
    assert np.array_equal(again.tokens, original["tokens"])
    assert table_files(cache_dir) == [path]
    assert open_table(dataset, config, cache_dir).tokens.tolist() == original["tokens"].tolist()
    assert len(computes) == 2                       # the rewritten file is whole again


BUILDER = """
import sys
from mimo_data.loading.token_table import token_table
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.preprocessor import Preprocessor
from mimo_data.shards.reader import ShardReader
dataset, config = sys.argv[1:3]
preprocessor = Preprocessor(PreprocessConfig.from_yaml(config), with_media=False)
table = token_table(ShardReader(dataset), preprocessor)
print(int(table.tokens.sum()))
"""


def test_concurrent_builders_leave_one_valid_table(ranks, dataset, tmp_path):
    """Two builder processes at once (two forked ranks of one job, each its own process)."""
    config = preprocess_config_file(tmp_path / "p.yaml")
    cache_dir = tmp_path / "cache"
    builder = tmp_path / "builder.py"
    builder.write_text(BUILDER)
    logs = tmp_path / "logs"
    job = ranks.run(2, [builder, dataset, config], logs,
                    env={cache.CACHE_DIR_ENV: cache_dir}, timeout=300)
    assert job.codes == [0, 0], job.explain()
    outputs = [((logs / f"rank_{r}.out").read_text(), job.ranks[r]) for r in range(2)]
    files = list(cache_dir.rglob("*"))
    tokens = [p for p in files if p.name.startswith("tokens-")]
    assert len(tokens) == 1 and not [p for p in files if ".tmp-" in p.name], files
    serial = open_table(dataset, config, tmp_path / "serial")
    assert [int(out) for out, _ in outputs] == [int(serial.tokens.sum())] * 2
    key = tables.table_key(
        ShardReader(str(dataset)),
        Preprocessor(PreprocessConfig.from_yaml(str(config)), with_media=False))
    assert cache.read_table(str(tokens[0]), key) is not None


def test_the_cache_directory_environment_variable_wins(dataset, tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "from-env"))
    open_table(dataset, preprocess_config_file(tmp_path / "p.yaml"), tmp_path / "configured")
    assert len(table_files(tmp_path / "from-env")) == 1
    assert table_files(tmp_path / "configured") == []
    # as a Dockerfile's ENV line leaves it: '~' is the home folder, not a folder named '~'
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(cache.CACHE_DIR_ENV, "~/mimo-cache")
    monkeypatch.chdir(tmp_path)
    open_table(dataset, preprocess_config_file(tmp_path / "p.yaml"), tmp_path / "configured")
    assert len(table_files(tmp_path / "home" / "mimo-cache")) == 1
    assert not (tmp_path / "~").exists() and table_files(tmp_path / "configured") == []


def test_inspect_report_writes_the_table_training_uses_and_reuses_it(dataset, tmp_path,
                                                                     computes, monkeypatch):
    from mimo_data.inspect import report as reports
    from mimo_data.inspect.checks import Thresholds
    from mimo_data.inspect.stats import SampleInspector

    config = _with(preprocess_config_file(tmp_path / "p.yaml"), seq_length=256)  # some drops
    cache_dir = tmp_path / "cache"
    inspector = SampleInspector(PreprocessConfig.from_yaml(str(config)))
    first = reports.build_report(str(dataset), inspector, Thresholds(), progress=False,
                                 cache_dir=str(cache_dir))
    assert first["tables"]["reused"] is False and first["kept"] > 0 and first["dropped"] > 0
    # training's start-up finds the report's table: nothing computed, the same table
    written = open_table(dataset, config, cache_dir)
    assert computes == []
    fresh = tables.compute(ShardReader(str(dataset)), Preprocessor(
        PreprocessConfig.from_yaml(str(config)), with_media=False))
    assert cache.columns_digest(fresh) == cache.columns_digest(
        pa.ipc.open_file(pa.memory_map(first["tables"]["token_table"])).read_all())
    assert written.tokens.tolist() == fresh.column("tokens").to_pylist()

    def no_sample(*args, **kwargs):
        raise AssertionError("a sample was inspected although the tables are saved")
    monkeypatch.setattr(reports, "inspect_dataset", no_sample)
    again = reports.build_report(str(dataset), SampleInspector(
        PreprocessConfig.from_yaml(str(config))), Thresholds(), progress=False,
        cache_dir=str(cache_dir))
    assert again["tables"]["reused"] is True
    varying = ("seconds", "samples_per_second", "tables", "token_cache")
    assert {k: v for k, v in again.items() if k not in varying} == \
        {k: v for k, v in first.items() if k not in varying}
    with pytest.raises(AssertionError, match="a sample was inspected"):
        reports.build_report(str(dataset), SampleInspector(PreprocessConfig.from_yaml(
            str(config))), Thresholds(), progress=False, cache_dir=str(cache_dir), reuse=False)
    # a shard lost since the tables were saved: the reused report fails, as a pass would
    import shutil

    from mimo_data.shards.index import DatasetError
    shard = sorted(dataset.glob("*.tar"))[-1]
    moved = shutil.move(shard, tmp_path / shard.name)
    try:
        with pytest.raises(DatasetError, match=f"shard {shard.name} missing"):
            reports.build_report(str(dataset), SampleInspector(PreprocessConfig.from_yaml(
                str(config))), Thresholds(), progress=False, cache_dir=str(cache_dir))
    finally:
        shutil.move(moved, shard)


def test_an_empty_dataset_has_an_empty_table(tmp_path, computes):
    """A dataset of no sample, as `mimo-shard index` wrote one for tars it kept nothing of
    before it left its report alone there, as a build does: its index written by hand."""
    from mimo_data.shards.in_place import _index_into
    from mimo_data.shards.tar_sources import IndexOptions, resolve
    write_tar(tmp_path / "tars" / "data-000000.tar",
              {"a.jpg": b"not a jpeg", "a.txt": b"a caption"})
    empty = tmp_path / "empty"
    options = IndexOptions(workers=0, progress=False)
    empty.mkdir()
    built, _, _ = _index_into(str(empty), resolve([str(tmp_path / "tars")], options, None),
                              options, None)
    assert built["totals"]["samples"] == 0
    (empty / "index.json").write_text(json.dumps(built))
    config = preprocess_config_file(tmp_path / "p.yaml")
    for _ in range(2):
        table = open_table(empty, config, tmp_path / "cache")
        assert len(table) == 0 and table.items("image").tolist() == []
    assert len(computes) == 1                       # the empty table was saved and read back


def test_a_table_that_cannot_be_saved_is_used_from_memory_with_a_warning(
        dataset, tmp_path, monkeypatch, capsys):
    config = preprocess_config_file(tmp_path / "p.yaml")
    expected = open_table(dataset, config, tmp_path / "saved").tokens.tolist()
    sample_table_dir = tmp_path / "full"
    open_table(dataset, config, sample_table_dir)           # sample table saved first

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    for path in table_files(sample_table_dir):
        path.unlink()                                       # the token table must be computed
    monkeypatch.setattr(cache, "write_table", full_disk)
    table = open_table(dataset, config, sample_table_dir)
    assert table.tokens.tolist() == expected and table.path is None
    assert "could not save" in capsys.readouterr().err and table_files(sample_table_dir) == []


def test_a_failure_on_several_ranks_is_said_once_with_its_ranks():
    """``Partition.together`` gathers every rank's error: the same one (every rank finding the
    cache folder unusable, say) is said once with its ranks, others each with theirs."""
    gathered = [(None, "NotADirectoryError: cache"), (None, "NotADirectoryError: cache"),
                (None, "OSError: disk full")]
    partition = tables.Partition(0, 3, lambda mine: gathered, writes=True)
    with pytest.raises(tables.TableError) as failed:
        partition.together(lambda: None)
    assert str(failed.value) == ("ranks 0, 1: NotADirectoryError: cache; rank 2: OSError: "
                                 "disk full")
    assert failed.value.gathered_failures == {"NotADirectoryError: cache": [0, 1],
                                     "OSError: disk full": [2]}
