"""The layout-aware loader on the real corpus: exactly-once per module, the same ordered global
micro-batches for every module, equal step counts on uneven data, exact resume (same layout,
other layout, other worker count), fingerprint checks, load-time drops, the dry run.

Expected sample sets come from samples.parquet read with pyarrow and from the corpus inputs,
never from the loader's own order.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import defaultdict

import pyarrow.parquet as pq
import pytest
import torch

from mimo_data.loading.dry_run import dry_run, main as dry_run_main
from mimo_data.shards.index import DatasetError
from mimo_data.loading.layout import LANGUAGE, Layout
from mimo_data.loading import loader as loader_module
from mimo_data.loading.loader import DataSource, LoaderError, build_loader
from mimo_data.loading.sample_order import OrderError

from conftest import (CORPUS_DIR, build_dataset, preprocess_config_file, rerecord_member,
                      write_jsonl)

GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict:
    """full: images (dynamic) + audio; image: dynamic images only (audio samples dropped);
    fixed: fixed-resolution images only (allows encoder dp > language dp)."""
    folder = tmp_path_factory.mktemp("configs")
    return {"full": preprocess_config_file(folder / "full.yaml"),
            "image": preprocess_config_file(folder / "image.yaml", image={"max_pixels": 50176}),
            "fixed": preprocess_config_file(folder / "fixed.yaml",
                                            image={"policy": "fixed", "image_size": 112})}


@pytest.fixture(scope="module")
def sources(loader_corpus, configs) -> dict:
    return {name: DataSource(str(loader_corpus), path) for name, path in configs.items()}


@pytest.fixture(scope="module")
def table(loader_corpus) -> list[dict]:
    return pq.read_table(loader_corpus / "samples.parquet").to_pylist()


def expected_kept(table, config: str) -> set[str]:
    """Sample ids the config keeps: all for full; without audio for image-only configs."""
    return {f"0/{row['key']}" for row in table if config == "full" or not row["audio_duration"]}


def item_count(table, modality: str) -> dict[str, int]:
    column = "image_width" if modality == "image" else "audio_duration"
    return {f"0/{row['key']}": len(row[column]) for row in table}


def encoder_items(inputs: dict, modality: str) -> int:
    (kwargs,) = inputs.values()
    if modality == "audio":
        return len(kwargs["feature_lens"])
    return len(kwargs["image_grid_thw"]) if "image_grid_thw" in kwargs else \
        len(kwargs["pixel_values"])


def run_epoch(source, layout, micro, seed=11, **options) -> dict[int, list]:
    """Every rank's ``(batch, metadata)`` micro-batches over one epoch."""
    layout = Layout.parse(layout)
    streams = {}
    for rank in range(layout.world_size):
        loader = build_loader(source, None, layout, rank, layout.world_size, GLOBAL_BATCH,
                              micro, seed, **options)
        if loader is not None:
            streams[rank] = list(loader)
            loader.close()
    return streams


def module_parts(layout: Layout, streams) -> dict[str, dict[int, list[list[str]]]]:
    """module -> dp rank -> the keys of each micro-batch, asserting that all ranks of one DP
    rank (tp, cp, pipeline stages) got the same samples."""
    parts: dict[str, dict[int, list]] = defaultdict(dict)
    for rank, stream in streams.items():
        role = layout.role(rank)
        for part in role.modules:
            if part.name != LANGUAGE and not part.first_stage:
                continue
            modality = next((m for m, n in role.media.items() if n == part.name), None)
            keys = [meta["keys"] if part.name == role.text_module
                    else meta["encoder_keys"][modality] for _, meta in stream]
            assert parts[part.name].setdefault(part.dp_rank, keys) == keys, (rank, part.name)
    return parts


LAYOUTS = [
    ("language=dp1;image=dp1,off0;audio=dp1,off0", "full", 2),   # one rank, colocated
    ("language=dp2;image=dp1", "image", 2),
    ("language=dp1;image=dp2", "fixed", 2),
    ("language=pp2,dp1;image=dp2", "fixed", 2),
    ("language=dp2;image=dp2;audio=dp1", "full", 1),
]


@pytest.mark.parametrize("layout_text, config, micro", LAYOUTS)
def test_every_module_gets_every_kept_sample_once_in_the_same_order(
        sources, table, layout_text, config, micro):
    layout = Layout.parse(layout_text)
    streams = run_epoch(sources[config], layout, micro)
    assert sorted(streams) == list(range(layout.world_size))       # every rank needs data
    kept = expected_kept(table, config)
    group = micro * layout.language.dp
    per_epoch = (len(kept) // GLOBAL_BATCH) * (GLOBAL_BATCH // group)
    assert {len(stream) for stream in streams.values()} == {per_epoch}
    parts = module_parts(layout, streams)
    assert set(parts) == {m.name for m in layout.modules}
    sequences = {}
    for name, by_dp in parts.items():
        dp = layout.module(name).dp
        assert sorted(by_dp) == list(range(dp))
        assert all(len(keys) == group // dp for r in by_dp for keys in by_dp[r])
        sequences[name] = [sum(micro_parts, []) for micro_parts in
                           zip(*(by_dp[r] for r in range(dp)))]
        served = sum(sequences[name], [])
        assert len(served) == len(set(served)), f"{name} repeats samples"
        assert set(served) <= kept
        assert len(kept - set(served)) == len(kept) % GLOBAL_BATCH     # the dropped remainder
    reference = sequences[LANGUAGE]
    assert all(sequence == reference for sequence in sequences.values())
    # Text agreement: an encoder rank's input_ids row of a sample is the language rank's row.
    rows = {}
    counts = {m: item_count(table, m) for m in ("image", "audio")}
    for rank, stream in streams.items():
        role = layout.role(rank)
        for batch, meta in stream:
            if "input_ids" in batch:
                for key, row in zip(meta["keys"], batch["input_ids"]):
                    assert torch.equal(rows.setdefault(key, row), row), key
            for modality in role.media:
                expected = sum(counts[modality][k] for k in meta["encoder_keys"][modality])
                inputs = batch["modality_inputs"].get(modality)
                assert (encoder_items(inputs, modality) if inputs else 0) == expected


def test_a_loader_says_what_it_drops(sources, table, tmp_path, loader_corpus, configs):
    """The line training prints when its loaders are ready: samples kept and dropped by
    reason (the image-only config drops the audio samples) and the remainder left out."""
    layout = Layout.parse("language=dp1;image=dp1")
    loader = build_loader(sources["image"], None, layout, 0, 2, GLOBAL_BATCH, 2, 11)
    kept = expected_kept(table, "image")
    dropped = len(table) - len(kept)
    line = loader.summary()
    assert line.startswith(f"{len(table)} samples, {len(kept)} kept, {dropped} dropped (")
    assert line.endswith(f"; {len(kept) // GLOBAL_BATCH} step(s) an epoch; "
                         f"{len(kept) % GLOBAL_BATCH} sample(s) an epoch left out by the "
                         "remainder (drop)"), line
    reasons = loader.report()["samples"]["skipped_by_reason"]
    assert sum(entry["count"] for entry in reasons.values()) == dropped > 0
    loader.close()
    # records the build skipped are said too: the run trains without them
    records = [{"image": str(tmp_path / name), "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]}
        for name in ("gone.png", "gone.png", "gone.png")]
    records[0]["image"] = str(next((CORPUS_DIR / "images").glob("*.jpg")))
    build_dataset([write_jsonl(tmp_path / "in.jsonl", records)], tmp_path / "ds")
    loader = build_loader(str(tmp_path / "ds"), configs["image"], layout, 0, 2, 1, 1, 11)
    assert loader.summary().startswith("1 sample, 1 kept (the build skipped 2 record(s): "
                                       "mimo-inspect report names them); 1 step(s) an epoch")
    # records an Energon split.yaml excludes (counted among the skipped) are the data's own
    # choice, not the build's skips: not said
    (reader,) = loader.source.readers
    reader.index["report"]["records_excluded"] = reader.index["report"]["records_skipped"]
    assert loader.summary().startswith("1 sample, 1 kept; 1 step(s) an epoch"), loader.summary()
    loader.close()
    packed = build_loader(sources["image"], None, layout, 0, 2, GLOBAL_BATCH, 2, 11,
                          packing=True)
    assert packed is not None and packed.summary() == f"{line}; packed"
    packed.close()
    balanced = build_loader(sources["image"], None, layout, 0, 2, GLOBAL_BATCH, 2, 11,
                            packing=True, balance="tokens")
    assert balanced is not None and balanced.summary() == f"{line}; token-balanced; packed"
    balanced.close()
    # fewer kept than a global batch: the drops are named with the error, too_long's remedy
    with pytest.raises(OrderError) as failed:
        build_loader(sources["image"], None, layout, 0, 2, 4 * len(kept) + 4, 2, 11)
    message = str(failed.value)
    assert f"an epoch holds {len(kept)} kept samples, fewer than one global batch of " \
        f"{4 * len(kept) + 4}: use a smaller global batch or more data. Preprocessing dropped " \
        f"some ({line.split('; ')[0]}): mimo-inspect report lists them" in message, message
    tight = preprocess_config_file(tmp_path / "tight.yaml", image={"max_pixels": 50176})
    tight.write_text(tight.read_text().replace("seq_length: 1024", "seq_length: 16"))
    # none kept: that said first (not "use a smaller global batch")
    with pytest.raises(OrderError, match=r"^preprocessing keeps none of the samples \(\d+ "
                       r"samples, 0 kept, \d+ dropped \(.*too_long \d+.*\); too_long: longer "
                       r"than seq_length 16, raise it\)"):
        build_loader(str(loader_corpus), tight, layout, 0, 2, GLOBAL_BATCH, 2, 11)


def test_the_language_rank_computes_its_next_micro_batches_text_together(sources, table,
                                                                         monkeypatch):
    """Text in one text_batch per TEXT_AHEAD records (per micro-batch it cost most of the
    language rank's time), the micro-batches those of a text_batch per micro-batch."""
    source = sources["full"]
    calls: list[int] = []
    text_batch = source.metadata.text_batch

    def counted(records):
        calls.append(len(records))
        return text_batch(records)

    monkeypatch.setattr(source.metadata, "text_batch", counted)
    streams = {}
    for ahead in (1, 5):
        monkeypatch.setattr(loader_module, "TEXT_AHEAD", ahead)
        calls.clear()
        language = build_loader(source, None, "language=dp1;image=dp1;audio=dp1", 0, 3,
                                GLOBAL_BATCH, 1, seed=11)
        streams[ahead] = list(language)
        served = len(expected_kept(table, "full")) // GLOBAL_BATCH * GLOBAL_BATCH
        assert len(streams[ahead]) == served
        # whole micro-batches of one sample each, up to TEXT_AHEAD, the last one what is left
        assert calls == [ahead] * (served // ahead) + [served % ahead] * bool(served % ahead)
    assert_same_stream(streams[5], streams[1])


def test_ranks_that_need_no_data_build_nothing(tmp_path):
    layout = "language=dp1;image=pp2,dp1"
    missing = str(tmp_path / "no-such-dataset")
    config = preprocess_config_file(tmp_path / "image.yaml", image={})
    assert build_loader(missing, config, layout, 2, 3, 8, 2, seed=0) is None
    with pytest.raises(DatasetError):
        build_loader(missing, config, layout, 0, 3, 8, 2, seed=0)


def flatten(batch) -> list:
    """Every tensor of a batch, in key order (nested modality inputs included)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for key in sorted(batch) for t in flatten(batch[key])]
    return []


def assert_same_stream(a: list, b: list):
    assert [meta["keys"] for _, meta in a] == [meta["keys"] for _, meta in b]
    for (batch_a, meta_a), (batch_b, meta_b) in zip(a, b):
        assert meta_a == meta_b
        assert sorted(batch_a) == sorted(batch_b)
        tensors_a, tensors_b = flatten(batch_a), flatten(batch_b)
        assert len(tensors_a) == len(tensors_b)
        assert all(torch.equal(x, y) for x, y in zip(tensors_a, tensors_b))


@pytest.mark.parametrize("workers", [(0, 0, 0), (0, 1, 2)])
def test_resume_mid_step_continues_exactly(sources, workers):
    """uninterrupted / first part / resumed part with these DataLoader worker counts."""
    layout = Layout.parse("language=dp2;image=dp1")
    whole, first_workers, rest_workers = workers
    consumed = 5                                        # step 1, micro-batch 1 of 4
    for rank in range(layout.world_size):
        options = dict(layout=layout, rank=rank, world_size=3, global_batch_size=GLOBAL_BATCH,
                       micro_batch_size=1, seed=4, datasets=sources["image"],
                       preprocess_config=None)
        rng = torch.get_rng_state()
        uninterrupted = list(build_loader(**options, num_workers=whole))
        first = build_loader(**options, num_workers=first_workers)
        head = [item for _, item in zip(range(consumed), first)]
        state = first.state_dict()
        assert (state["step"], state["micro_batch"]) == (1, 1)
        first.close()
        resumed = build_loader(**options, num_workers=rest_workers, state=state)
        tail = list(resumed)
        resumed.close()
        assert len(head) + len(tail) == len(uninterrupted)
        assert_same_stream(head + tail, uninterrupted)
        # a loader's iterator (a run's start, its resume, every evaluation's rewind) draws
        # nothing from torch's global generator: a draw there moved the training's dropout
        # (LoRA's, on the CPU), so that a run with evaluations or a resumed one trained others
        assert torch.equal(torch.get_rng_state(), rng), "the loader drew from torch's generator"


def leaves(value, path: str = "") -> dict[str, torch.Tensor]:
    """``{path: tensor}`` of a tensor or a nested dict of tensors."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    return {name: tensor for key in sorted(value)
            for name, tensor in leaves(value[key], f"{path}/{key}").items()}


def step_view(layout: Layout, streams, module: str, key: str) -> list[tuple]:
    """Per step: the global batch's keys and ``key``'s tensors of one module, concatenated over
    micro-batches and DP ranks (the same for any layout when the data is the same)."""
    by_dp = {}
    for rank, stream in streams.items():
        role = layout.role(rank)
        if not any(p.name == module and p.tp_rank == p.cp_rank == 0 for p in role.modules):
            continue
        part = role.module(module)
        if key == "modality_inputs" and module in role.media.values():
            modality = next(m for m, n in role.media.items() if n == module)
            by_dp[part.dp_rank] = [(meta["step"], meta["encoder_keys"][modality],
                                    batch["modality_inputs"].get(modality, {}))
                                   for batch, meta in stream]
        elif role.text_module == module and key in stream[0][0]:
            by_dp[part.dp_rank] = [(meta["step"], meta["keys"], batch[key])
                                   for batch, meta in stream]
    steps = defaultdict(lambda: ([], defaultdict(list)))
    for micro in zip(*(by_dp[r] for r in sorted(by_dp))):
        for step, keys, value in micro:
            steps[step][0].extend(keys)
            for path, tensor in leaves(value).items():
                steps[step][1][path].append(tensor)
    return [(step, keys, {path: torch.cat(tensors) for path, tensors in values.items()})
            for step, (keys, values) in sorted(steps.items())]


@pytest.mark.parametrize("other, other_micro", [("language=dp1;image=dp1", 2),
                                                ("language=dp2,off0;image=dp2,off0", 1),
                                                ("language=pp2,dp2;image=dp1", 2)])
def test_resume_under_another_layout_continues_the_same_global_batches(sources, other,
                                                                      other_micro):
    source = sources["image"]
    layout, other = Layout.parse("language=dp2;image=dp1"), Layout.parse(other)
    whole = run_epoch(source, layout, 2, seed=9)
    consumed_steps = 2
    states = []
    first = {}
    for rank in range(layout.world_size):
        loader = build_loader(source, None, layout, rank, 3, GLOBAL_BATCH, 2, 9)
        count = consumed_steps * loader.micro_batches_per_step
        first[rank] = [item for _, item in zip(range(count), loader)]
        states.append(loader.state_dict())
        loader.close()
    assert all(state == states[0] for state in states)     # every rank stopped at one point
    rest = {}
    for rank in range(other.world_size):
        loader = build_loader(source, None, other, rank, other.world_size, GLOBAL_BATCH,
                              other_micro, 9, state=states[0])
        rest[rank] = list(loader)
        loader.close()
    for module, key in ((LANGUAGE, "input_ids"), (LANGUAGE, "labels"),
                        ("image", "modality_inputs")):
        expected = step_view(layout, whole, module, key)
        got = step_view(layout, first, module, key) + step_view(other, rest, module, key)
        assert [step for step, _, _ in got] == list(range(len(expected)))
        for (_, keys_a, values_a), (_, keys_b, values_b) in zip(expected, got):
            assert keys_a == keys_b
            assert sorted(values_a) == sorted(values_b) and values_a
            assert all(torch.equal(values_a[path], values_b[path]) for path in values_a)


def test_state_checks_fingerprint_seed_batch_and_position(sources, tmp_path, corpus_inputs,
                                                         configs):
    layout = "language=dp2;image=dp1"
    loader = build_loader(sources["image"], None, layout, 0, 3, GLOBAL_BATCH, 1, seed=3)
    for _ in zip(range(3), loader):
        pass
    state = loader.state_dict()
    # tiny: a few values a dataset (what its fingerprint is of), none a sample
    assert len(json.dumps({k: v for k, v in state.items() if k != "data"})) < 400
    assert [set(d) for d in state["data"]["datasets"]] == [
        {"directory", "index", "kept", "kept_digest"}]
    other = tmp_path / "other"
    build_dataset(corpus_inputs, other, max_samples_per_shard=20, check="header")
    corpus = sources["image"].directories[0]
    with pytest.raises(LoaderError, match=f"fingerprint .*: {other}: another index than "
                       f"{corpus}'s then \\(rebuilt, or other shards\\)\\), so the order "
                       r"would not continue.*start a new run from them "
                       r"\(model.init_from=CHECKPOINT"):
        build_loader(str(other), configs["image"], layout, 0, 3, GLOBAL_BATCH, 1, 3, state=state)
    # what else changes the data is named: a dataset added, the blend's weights; the samples
    # preprocessing keeps (``data_changes`` itself)
    with pytest.raises(LoaderError, match=rf": 1 dataset\(s\) then \({corpus}\), 2 now "
                       rf"\({corpus}, {other}\); blend weights none \(each dataset by its "
                       r"size\) then, 0.5, 0.5 now \(as shares\)\)"):
        build_loader([corpus, str(other)], configs["image"], layout, 0, 3, GLOBAL_BATCH, 1, 3,
                     weights=[1, 1], state=state)
    from mimo_data.loading.loader import data_changes
    then = state["data"]["datasets"][0]
    kept = then["kept"]
    assert data_changes({**state["data"], "datasets": [{**then, "kept": 3, "kept_digest": "0"}]},
                        state["data"]) == f"{corpus}: preprocessing keeps {kept} of its " \
        "samples now, 3 then"
    assert data_changes({**state["data"], "datasets": [{**then, "kept_digest": "0"}]},
                        state["data"]) == f"{corpus}: preprocessing keeps other samples than then"
    assert data_changes(state["data"], state["data"]) == ""
    # the same folder rebuilt (the usual case): its index named, not left to the generic text
    assert data_changes({**state["data"], "datasets": [{**then, "index": "0"}]},
                        state["data"]) == f"{corpus}: another index than {corpus}'s then " \
        "(rebuilt, or other shards)"
    two = {"datasets": [then, {**then, "directory": "b", "index": "1"}], "weights": [0.25, 0.75]}
    assert data_changes(two, {"datasets": two["datasets"][::-1], "weights": [0.75, 0.25]}) == \
        f"the same datasets in another order ({corpus}, b then, b, {corpus} now); blend " \
        "weights 0.25, 0.75 then, 0.75, 0.25 now (as shares)"
    # weights written otherwise for the same blend ([1, 2] then, [0.3, 0.6] now: shares
    # that differ in their last bits) give each dataset the same samples: the run resumes
    blend = build_loader([corpus, str(other)], configs["image"], layout, 0, 3, GLOBAL_BATCH,
                         1, 3, weights=[1, 2])
    for _ in zip(range(3), blend):
        pass
    blended = blend.state_dict()
    assert blended["data"]["weights"] != [w / sum([0.3, 0.6]) for w in [0.3, 0.6]]
    resumed = build_loader([corpus, str(other)], configs["image"], layout, 0, 3, GLOBAL_BATCH,
                           1, 3, weights=[0.3, 0.6], state=blended)
    following = next(iter(blend))[1]["keys"]
    assert following and next(iter(resumed))[1]["keys"] == following
    # a blend whose shares match but for their last bits, rounded to other quotas (a largest
    # remainder's tie broken the other way: [5, 9] then, [0.5, 0.9] now on 1 and 20 kept
    # samples give 8, 13 then, 7, 14 now): refused, not resumed into another order
    rounded = dict(blended, quotas=[q + (1 if i else -1) for i, q in
                                    enumerate(blended["quotas"])])
    with pytest.raises(LoaderError, match=r"the loader state's blend gave its datasets .* "
                       r"samples an epoch, these weights give"):
        build_loader([corpus, str(other)], configs["image"], layout, 0, 3, GLOBAL_BATCH, 1, 3,
                     weights=[0.3, 0.6], state=rounded)
    with pytest.raises(LoaderError, match=r"blend weights 0.333, 0.667 then, 0.25, 0.75 now"):
        build_loader([corpus, str(other)], configs["image"], layout, 0, 3, GLOBAL_BATCH, 1, 3,
                     weights=[1, 3], state=blended)
    allowed = build_loader(str(other), configs["image"], layout, 0, 3, GLOBAL_BATCH, 1, 3,
                           state=state, allow_fingerprint_mismatch=True)
    assert (allowed.epoch, allowed.state_dict()["sample_offset"]) == (0, 6)
    with pytest.raises(LoaderError, match="seed 3"):
        build_loader(sources["image"], None, layout, 0, 3, GLOBAL_BATCH, 1, 4, state=state)
    with pytest.raises(LoaderError, match="global batch 8"):
        build_loader(sources["image"], None, layout, 0, 3, 16, 1, 3, state=state)
    with pytest.raises(LoaderError, match="6 samples into epoch 0"):   # 6 is not a multiple of 4
        build_loader(sources["image"], None, layout, 0, 3, GLOBAL_BATCH, 2, 3, state=state)
    # a state edited by hand or another program's: a negative position would read the epoch's
    # end as its start (a slice from the end), never silently
    for edited in ({"sample_offset": -2}, {"epoch": -1}, {"sample_offset": "6"}):
        with pytest.raises(LoaderError, match="must be whole numbers >= 0"):
            build_loader(sources["image"], None, layout, 0, 3, GLOBAL_BATCH, 1, 3,
                         state={**state, **edited})


def test_forked_workers_inherit_the_epoch_order_their_rank_made(loader_corpus, configs,
                                                                tmp_path, monkeypatch):
    """A rank with DataLoader workers makes the epoch's order once, before starting them:
    forked, they inherit it (its pages shared) instead of each making its own (about 12 bytes
    a sample and seconds at 10M samples, a worker); the rank then drops its own reference. A
    spawned worker is not sent it."""
    import pickle

    from mimo_data.loading import sample_order
    made = tmp_path / "made"
    real = sample_order.SampleOrder.dataset_order

    def recorded(self, *args):
        with open(made, "a") as log:
            log.write(f"{os.getpid()}\n")
        return real(self, *args)
    monkeypatch.setattr(sample_order.SampleOrder, "dataset_order", recorded)
    source = DataSource(str(loader_corpus), configs["image"])     # no order made yet
    loader = build_loader(source, None, "language=dp2;image=dp1", 2, 3, GLOBAL_BATCH, 1, 7,
                          num_workers=2)
    next(iter(loader))
    assert loader.order._cached is None         # the rank keeps no copy once they have it
    loader.close()
    assert made.read_text().split() == [str(os.getpid())]
    order = source.order(7, GLOBAL_BATCH)
    order.epoch(0)
    assert order._cached is not None and pickle.loads(pickle.dumps(order))._cached is None


def test_a_drop_only_decoding_can_see_is_an_error_not_a_skip(tmp_path, assets, configs):
    records = [{"id": f"r{i}", "image": str(assets["png"]),
                "conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                                  {"from": "gpt", "value": f"Picture {i}."}]} for i in range(2)]
    dataset = tmp_path / "ds"
    build_dataset([write_jsonl(tmp_path / "in.jsonl", records)], dataset)
    # Damage the second sample's image inside its tar and record the damaged bytes' crc32, as
    # a `--check header` build of a file already damaged at its source would: its metadata
    # stays valid and its bytes are what the build wrote, so only decoding can tell. (Bytes
    # changed after the build fail the reader's crc32 check first: test_member_crc.py.)
    row = pq.read_table(dataset / "samples.parquet").to_pylist()[1]
    member = next(m for m in row["members"] if m["name"].startswith("img"))
    with open(dataset / row["shard"], "r+b") as shard:
        shard.seek(member["offset"])
        shard.write(bytes(16))
    rerecord_member(dataset, row["key"], member["name"])
    layout = "language=dp1;image=dp1"
    language = build_loader(str(dataset), configs["image"], layout, 0, 2, 2, 2, 0)
    assert sorted(sum((meta["keys"] for _, meta in language), [])) == [
        f"0/{r['key']}" for r in pq.read_table(dataset / "samples.parquet").to_pylist()]
    images = build_loader(str(dataset), configs["image"], layout, 1, 2, 2, 2, 0)
    with pytest.raises(LoaderError) as error:
        list(images)
    assert f"0/{row['key']}" in str(error.value) and "mimo-shard verify" in str(error.value)
    # named where the build read it, as every other message names a record
    assert f"({tmp_path / 'in.jsonl'}:2, id 'r1') is dropped at load time" in str(error.value)
    # a tar's sample indexed in place: its tar and key
    from mimo_data.shards.format import record_origin
    assert record_origin({"source": {"file": "a.tar", "key": "000001"}, "id": 7}) == \
        "a.tar key 000001, id 7"


def test_spawned_workers_and_parallel_drop_decisions_agree(sources, loader_corpus, configs,
                                                          tmp_path, monkeypatch):
    # an empty cache directory: the token table is computed in 2 worker processes
    parallel = DataSource(str(loader_corpus), configs["image"], num_workers=2,
                          cache_dir=str(tmp_path / "cache"))
    assert list((tmp_path / "cache").rglob("tokens-*.arrow"))
    assert parallel.fingerprint == sources["image"].fingerprint
    assert parallel.tally.to_dict() == sources["image"].tally.to_dict()
    options = dict(layout="language=dp2;image=dp1", rank=2, world_size=3,
                   global_batch_size=GLOBAL_BATCH, micro_batch_size=2, seed=5,
                   preprocess_config=None)
    inline = list(build_loader(sources["image"], **options))
    spawned = build_loader(parallel, **options, num_workers=2, multiprocessing_context="spawn",
                           parent_signals=(signal.SIGTERM, signal.SIGUSR1))
    assert_same_stream(list(spawned), inline)
    # the run's exit signals (torchrun's and Slurm's reach every process) leave the workers
    # to their rank; one that torch's shutdown cannot stop (stuck in a read: here a shutdown
    # that does nothing) is killed by close, not left for the interpreter's exit to wait on
    workers = list(spawned._workers)
    assert len(workers) == 2
    for worker in workers:
        os.kill(worker.pid, signal.SIGTERM)
        os.kill(worker.pid, signal.SIGUSR1)
    time.sleep(0.5)
    assert all(worker.is_alive() for worker in workers)
    monkeypatch.setattr(type(spawned._stream), "_shutdown_workers", lambda self: None)
    spawned.close()
    assert not any(worker.is_alive() for worker in workers)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """Datasets of 303 samples (shards of 300 and 3) and of 3 samples, from corpus records."""
    folder = tmp_path_factory.mktemp("uneven")
    lines = [json.loads(line) for line in (CORPUS_DIR / "llava.jsonl").read_text().splitlines()
             if line.strip()]
    records = [dict(lines[i % len(lines)], id=f"r{i}") for i in range(303)]
    build_dataset([write_jsonl(folder / "big.jsonl", records)], folder / "big",
                        max_samples_per_shard=300, check="header", media_root=str(CORPUS_DIR))
    build_dataset([write_jsonl(folder / "small.jsonl", records[:3])], folder / "small",
                  check="header", media_root=str(CORPUS_DIR))
    index = json.loads((folder / "big" / "index.json").read_text())
    assert [shard["samples"] for shard in index["shards"]] == [300, 3]
    return folder


def test_a_state_is_refused_by_other_shares_kept_samples_version_or_an_epoch_it_is_past(
        sources, uneven, configs):
    """What changes the order is refused, each said: the blend's shares (the same shares in
    other numbers are taken), the samples preprocessing keeps of the same dataset (the image
    config drops the audio samples the full one keeps), a state of another version; and a
    position past this epoch's end (allow_fingerprint_mismatch onto fewer samples)."""
    layout, options = "language=dp2;image=dp1;audio=dp1", dict(decode_media=False)
    datasets = [str(uneven / "small"), str(uneven / "big")]

    def loader(weights, state=None, source=None):
        return build_loader(source or DataSource(datasets, configs["full"], weights), None,
                            layout, 0, 4, GLOBAL_BATCH, 2, 11, state=state, **options)
    state = loader([1, 1]).state_dict()
    assert loader([2, 2], state).step == 0
    with pytest.raises(LoaderError, match=r"blend weights 0.5, 0.5 then, 0.75, 0.25 now"):
        loader([3, 1], state)
    full = loader(None, source=sources["full"])
    corpus = sources["full"].directories[0]
    with pytest.raises(LoaderError, match=rf"fingerprint .*: {corpus}: preprocessing keeps "
                       r"\d+ of its samples now, \d+ then\)"):
        build_loader(sources["image"], None, "language=dp2;image=dp1", 0, 3, GLOBAL_BATCH, 2,
                     11, state=full.state_dict())
    with pytest.raises(LoaderError, match="not a mimo-loader-state version 1 state: "
                       "'mimo-loader-state' version 2"):
        loader(None, {**full.state_dict(), "version": 2}, sources["full"])
    end = full.order.samples_per_epoch
    with pytest.raises(LoaderError, match=f"stopped {end} samples into epoch 0"):
        loader(None, {**full.state_dict(), "sample_offset": end}, sources["full"])


@pytest.mark.parametrize("datasets, weights", [(["big"], None), (["small", "big"], None),
                                               (["small", "big"], [1, 1])])
def test_uneven_shards_and_blends_give_equal_step_counts(uneven, configs, datasets, weights):
    layout = Layout.parse("language=dp2;image=dp1;audio=dp1")
    source = DataSource([str(uneven / d) for d in datasets], configs["full"], weights)
    total = 303 + 3 * (len(datasets) - 1)
    assert source.tally.kept == total                     # the records are all trainable
    streams = run_epoch(source, layout, 2, decode_media=False)
    counts = {rank: len(stream) for rank, stream in streams.items()}
    assert set(counts.values()) == {(total // GLOBAL_BATCH) * (GLOBAL_BATCH // 4)}, counts
    served = [key for _, meta in streams[3] for key in meta["keys"]]
    if weights is None:
        assert len(served) == len(set(served))
    else:        # half the epoch from the 3-sample dataset, every pass over it whole
        small = [key for key in served if key.startswith("0/")]
        assert abs(len(small) - len(served) / 2) <= GLOBAL_BATCH
        counts = [small.count(key) for key in set(small)]
        assert len(counts) == 3 and max(counts) - min(counts) <= 1
    # training's start-up line says what an epoch draws from each dataset: all it keeps, or
    # the weights' equal halves of the 306 (the small dataset's 3 repeated)
    loader = build_loader(source, None, layout, 0, 4, GLOBAL_BATCH, 2, 11, decode_media=False)
    assert loader is not None
    drawn = "" if len(datasets) == 1 else "; an epoch draws " + (
        "3 + 303" if weights is None else "153 + 153") + " samples of the 2 datasets (kept " \
        "3 + 303)"
    assert loader.summary() == f"{total} samples, {total} kept{drawn}; " \
        f"{total // GLOBAL_BATCH} step(s) an epoch; {total % GLOBAL_BATCH} sample(s) an " \
        "epoch left out by the remainder (drop)"
    # records the builds skipped, summed over the datasets
    for reader in source.readers:
        reader.index["report"] = {**reader.index.get("report", {}), "records_skipped": 1}
    built = "the builds skipped 2" if len(datasets) > 1 else "the build skipped 1"
    assert loader.summary().startswith(f"{total} samples, {total} kept ({built} record(s): "
                                       "mimo-inspect report names them)"), loader.summary()
    loader.close()


def test_dry_run_matches_the_decoding_loader_and_is_json(sources, loader_corpus, configs,
                                                         capsys):
    layout = "language=dp2;image=dp1"
    result = dry_run(sources["image"], None, layout, GLOBAL_BATCH, 2, seed=11)
    assert result["checks"] == {"ok": True, "problems": []}
    json.dumps(result)
    decoded = run_epoch(sources["image"], layout, 2)
    for entry in result["ranks"]:
        planned = [mb["keys"] for step in entry["steps"] for mb in step["micro_batches"]]
        assert planned == [meta["keys"] for _, meta in decoded[entry["rank"]]]
        tokens = [mb["tokens"] for step in entry["steps"] for mb in step["micro_batches"]]
        if entry["role"]["text_module"] == LANGUAGE:
            assert tokens == [batch["attention_mask"].sum(1).tolist()
                              for batch, _ in decoded[entry["rank"]]]
    code = dry_run_main([str(loader_corpus), "--config", str(configs["image"]), "--layout",
                         layout, "--global-batch-size", "8", "--micro-batch-size", "2",
                         "--steps", "1", "--seed", "11", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0 and printed["ranks"][2]["steps"] == result["ranks"][2]["steps"][:1]
    # the run's balance and packing, as the run (and mimo-inspect plan) lays them out
    code = dry_run_main([str(loader_corpus), "--config", str(configs["image"]), "--layout",
                         layout, "--global-batch-size", "8", "--micro-batch-size", "2",
                         "--steps", "1", "--seed", "11", "--json", "--balance", "tokens",
                         "--packing"])
    printed = json.loads(capsys.readouterr().out)
    planned = dry_run([str(loader_corpus)], configs["image"], layout, 8, 2, seed=11, steps=1,
                      balance="tokens", packing=True)
    assert code == 0 and printed["ranks"] == planned["ranks"]
    assert (printed["balance"], printed["packing"]) == ("tokens", True)
    assert any("sequences" in mb for entry in printed["ranks"] for step in entry["steps"] or ()
               for mb in step["micro_batches"])                    # packed, as asked
    # fan-in of dynamic-resolution images: each image DP rank gets its half of the language
    # rank's micro-batch, in order
    code = dry_run_main([str(loader_corpus), "--config", str(configs["image"]), "--layout",
                         "language=dp1;image=dp2", "--global-batch-size", "8",
                         "--micro-batch-size", "2", "--steps", "2", "--json"])
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert code == 0
    language, *images = [[mb["keys"] for step in entry["steps"] for mb in step["micro_batches"]]
                         for entry in sorted(ranks, key=lambda e: e["role"]["text_module"] !=
                                             LANGUAGE)]
    assert len(language) == 8 and all(len(keys) == 2 for keys in language)
    assert [a + b for a, b in zip(*images)] == language
