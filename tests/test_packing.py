"""Sequence packing (``data.packing``): the plan (first-fit-decreasing per language DP part)
and the packed batch (THD: samples back to back, positions restarting, ``cu_seqlens``).
Training parity packed vs unpacked (the attention included) is in tests/test_train_parity.py;
exactly-once and resume under torchrun in tests/test_loader_dist.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import preprocess_config_file
from mimo_data.loading.loader import DataSource, build_loader
from mimo_data.loading.packing import PackingError, next_fit, pack_parts
from mimo_data.preprocess.collate import BatchError, Collator

LAYOUT = "language=dp2;image=dp1;audio=dp1"


def test_first_fit_decreasing_by_hand():
    # 6 opens sequence 0, 5 opens 1, 4 joins 0 (10), 3 and 2 join 1 (8, 10)
    within, sequences = pack_parts(np.array([[6, 5, 4, 3, 2], [9, 1, 9, 1, 9]]), 10)
    assert within[0].tolist() == [0, 2, 1, 3, 4] and sequences[0] == 2
    # 9, 9, 9 open three sequences; the 1s join the first two
    assert within[1].tolist() == [0, 1, 2, 3, 4] and sequences[1] == 3


def test_plans_are_permutations_of_full_sequences_that_next_fit_finds_again():
    rng = np.random.default_rng(5)
    lengths = np.minimum(rng.lognormal(5, 1, size=(500, 8)).astype(int) + 1, 1024)
    within, sequences = pack_parts(lengths, 1024)
    for part, order, count in zip(lengths, within, sequences):
        assert sorted(order.tolist()) == list(range(8))
        packed = part[order]
        cut = next_fit(packed.tolist(), 1024)
        assert len(cut) == count and sum(cut) == 8
        ends = np.cumsum(cut)
        loads = [packed[end - n:end].sum() for n, end in zip(cut, ends)]
        assert max(loads) <= 1024
        # first-fit-decreasing never needs more than 11/9 OPT + 1 sequences; OPT >= tokens/cap
        assert count <= 11 / 9 * np.ceil(part.sum() / 1024) + 1
    assert sequences.mean() < 8 * 0.5           # long-tail lengths: far fewer rows than samples


def test_samples_of_equal_length_keep_their_order():
    """Ties are broken by place, not left to numpy's default sort (unstable beyond 16
    samples, its ties free to differ between numpy versions and CPUs): every rank, and a
    resume on another machine, packs alike; samples of one length keep their part's order."""
    rng = np.random.default_rng(1)
    lengths = rng.choice([3, 5], size=(4, 40))
    within, sequences = pack_parts(lengths, 10)
    assert sequences.tolist() == [17, 17, 18, 18]
    for part, order in zip(lengths, within):
        for length in (3, 5):
            places = order[part[order] == length]
            assert (np.diff(places) > 0).all(), (length, places.tolist())


def test_a_sample_longer_than_the_sequence_is_refused():
    with pytest.raises(PackingError, match="1..100"):
        pack_parts(np.array([[50, 101]]), 100)


def test_next_fit_cuts_in_order():
    assert next_fit([3, 4, 3, 5, 5, 1], 10) == [3, 2, 1]
    assert next_fit([], 10) == []


@pytest.fixture(scope="module")
def source(loader_corpus, tmp_path_factory):
    """seq_length 512: parts of 4 samples pack into more than one sequence (ranks 0 and 1:
    the language DP ranks)."""
    path = preprocess_config_file(tmp_path_factory.mktemp("packing") / "p.yaml")
    path.write_text(path.read_text().replace("seq_length: 1024", "seq_length: 512"))
    return DataSource(str(loader_corpus), path)


def micro_batches(source, packing: bool, rank: int = 0, balance: str = "none"):
    loader = build_loader(source, None, LAYOUT, rank, 4, 16, 4, seed=7, packing=packing,
                          balance=balance)
    return list(loader)


@pytest.mark.parametrize("balance", ["none", "tokens"])
def test_packing_keeps_each_micro_batch_and_packs_its_samples(source, balance):
    padded = [mb for rank in (0, 1) for mb in micro_batches(source, False, rank, balance)]
    packed = [mb for rank in (0, 1) for mb in micro_batches(source, True, rank, balance)]
    assert len(packed) == len(padded)
    moved = 0
    for (_, plain), (batch, meta) in zip(padded, packed):
        assert sorted(meta["keys"]) == sorted(plain["keys"])
        moved += meta["keys"] != plain["keys"]
        lengths = meta["tokens"]
        bounds = batch["packing_kwargs"]["cu_seqlens_q"].tolist()
        assert bounds == np.concatenate([[0], np.cumsum(lengths)]).tolist()
        assert batch["input_ids"].shape == (1, sum(lengths))
        assert batch["packing_kwargs"]["max_seqlen_q"] == max(lengths)
        # self-attention: the keys' bounds are the queries' (megatron-core's PackedSeqParams
        # reads both)
        assert batch["packing_kwargs"]["cu_seqlens_kv"].tolist() == bounds
        assert batch["packing_kwargs"]["max_seqlen_kv"] == max(lengths)
        assert sum(meta["sequences"]) == len(lengths)
        at = 0
        for count in meta["sequences"]:
            assert sum(lengths[at:at + count]) <= 512
            at += count
    assert moved, "packing never reordered a part: the test data does not exercise it"


def test_packed_rows_are_the_padded_rows_back_to_back(source):
    """Same samples, token for token: ids, labels and loss mask of each sample as in its
    padded row; positions restart at 0 at every sample."""
    padded = micro_batches(source, False)[:4]
    packed = micro_batches(source, True)[:4]
    for (rows, plain), (batch, meta) in zip(padded, packed):
        row_of = {key: row for row, key in enumerate(plain["keys"])}
        bounds = batch["packing_kwargs"]["cu_seqlens_q"].tolist()
        for key, start, end in zip(meta["keys"], bounds, bounds[1:]):
            row, n = row_of[key], end - start
            for name in ("input_ids", "labels", "loss_mask"):
                assert torch.equal(batch[name][0, start:end], rows[name][row, :n]), name
            assert not rows["attention_mask"][row, n:].any()
            assert batch["position_ids"][0, start:end].tolist() == list(range(n))


def test_packed_placeholder_counts_are_checked_per_sample(source):
    samples = [source.metadata.sample(text) for text in source.metadata.text_batch(
        [source.readers[0].record(i) for i in range(len(source.readers[0]))])
        if not isinstance(text, Exception)]
    with_image = next(s for s in samples if sum(s.token_counts["image"]))
    text_only = next(s for s in samples if not sum(s.token_counts["image"]))
    collate = Collator(source.metadata, packed=True)
    collate([text_only, with_image])                                    # consistent: fine
    # the counts swapped between the samples: equal totals, wrong sample boundaries
    wrong = [with_image.__class__(**{**vars(text_only),
                                     "token_counts": with_image.token_counts}),
             with_image.__class__(**{**vars(with_image),
                                     "token_counts": text_only.token_counts})]
    with pytest.raises(BatchError, match="placeholders"):
        collate(wrong)
    # one placeholder more than the sample's counts say (its first item's count one short)
    fewer = {**with_image.token_counts, "image": [with_image.token_counts["image"][0] - 1,
                                                  *with_image.token_counts["image"][1:]]}
    over = with_image.__class__(**{**vars(with_image), "token_counts": fewer})
    for packed in (True, False):
        with pytest.raises(BatchError, match=rf"{over.key}: \d+ image placeholders, token "
                           r"counts"):
            Collator(source.metadata, packed=packed)([text_only, over])
