"""Context parallelism's pieces that need no process group (``mimo_train.mcore.context_parallel``
and the trainer's padding, ``mimo_train.training.step``), in process: the cut of a sequence and
its gradient, the key/value heads repeated for the all-to-all, the padding a batch gets so that
cp x tp divides it, and the routers' real-token mask over that padding.

The whole path (all-to-alls, bridge, rotary, deepstack, delta-net, loss) against the colocated
step, loss and every gradient, runs in the models' own jobs: tests/test_qwen3_vl.py (cp2 packed
fan-in, cp4 padded; the mixture of experts with its balancing loss), tests/test_vlm_video.py
(Qwen2.5-VL at cp2, cp4, pp2 x cp2, tp2 x cp2), tests/test_qwen3_5.py (the gated delta-net at
cp2) and tests/test_train_run.py (a resume at cp2 and back).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from mimo_data.loading.layout import Layout
from mimo_data.preprocess.preprocessor import IGNORE_INDEX
from mimo_train.mcore.context_parallel import heads_for, shard, span
from mimo_train.training.step import model_inputs, real_tokens


@dataclass
class Group:
    """What the cut reads of a process group."""
    ranks: int
    me: int

    def size(self) -> int:
        return self.ranks

    def rank(self) -> int:
        return self.me


def test_each_rank_holds_one_contiguous_part_and_gets_its_gradient_only():
    tokens = torch.arange(8.0).reshape(8, 1, 1).requires_grad_()
    part = shard(tokens, 0, Group(4, 2))
    assert part.flatten().tolist() == [4.0, 5.0]
    part.sum().backward()
    assert tokens.grad.flatten().tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="9 tokens does not split over context-parallel size 2"):
        span(9, Group(2, 0))


@pytest.mark.parametrize("groups, heads, cp, repeat", [(2, 4, 2, 1), (2, 4, 4, 2), (1, 8, 4, 4),
                                                      (4, 8, 2, 1)])
def test_key_value_groups_are_repeated_to_a_multiple_of_cp_and_keep_their_queries(
        groups, heads, cp, repeat):
    """Query head i reads key/value group i // (heads / groups) before and after (the order
    megatron-core's attention repeats them in), and the count is a multiple of cp."""
    key = torch.arange(float(groups)).reshape(1, 1, groups, 1)
    repeated, _ = heads_for(key, key.clone(), heads, cp)
    count = repeated.size(-2)
    assert count == groups * repeat and count % cp == 0
    for query in range(heads):
        assert repeated[0, 0, query // (heads // count), 0] == \
            key[0, 0, query // (heads // groups), 0]


def _infra(layout: str) -> SimpleNamespace:
    return SimpleNamespace(layout=Layout.parse(layout))


def _packed(lengths: list[int]) -> dict:
    tokens = sum(lengths)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": torch.arange(1, tokens + 1)[None], "labels": torch.arange(tokens)[None],
            "loss_mask": torch.ones(1, tokens), "position_ids": torch.arange(tokens)[None],
            "attention_mask": torch.ones(1, tokens, dtype=torch.bool),
            "packing_kwargs": {"cu_seqlens_q": bounds, "cu_seqlens_kv": bounds.clone(),
                               "max_seqlen_q": max(lengths), "max_seqlen_kv": max(lengths)}}


def test_a_packed_row_is_padded_to_cp_x_tp_and_its_padding_joins_the_last_sample():
    batch = _packed([3, 6])                               # 9 tokens; language tp2 x cp2: 4
    inputs = model_inputs(batch, _infra("language=tp2,cp2"), torch.device("cpu"))
    assert inputs["input_ids"].tolist() == [[*range(1, 10), 0, 0, 0]]
    assert inputs["labels"][0, 9:].tolist() == [IGNORE_INDEX] * 3
    assert inputs["loss_mask"][0, 9:].tolist() == [0.0] * 3
    assert inputs["position_ids"][0, 9:].tolist() == [0] * 3
    packing = inputs["packing_kwargs"]
    assert packing["cu_seqlens_q"].tolist() == packing["cu_seqlens_kv"].tolist() == [0, 3, 12]
    assert packing["max_seqlen_q"] == packing["max_seqlen_kv"] == 9
    # the routers' real tokens: all but the padding; none added at cp1, nothing to mask
    assert real_tokens(batch, 4).tolist() == [[True] * 9 + [False] * 3]
    assert real_tokens(batch, 1) is None
    plain = model_inputs(batch, _infra("language=tp2"), torch.device("cpu"))
    assert plain["input_ids"].size(1) == 9 and plain["packing_kwargs"]["cu_seqlens_q"][-1] == 9


def test_what_the_step_keeps_for_later_is_on_its_device():
    """The MoE balance loss's real-token mask goes to the step's device with the batch, and a
    rank whose schedule reports no loss gives its zero sums there: on a GPU a router's or the
    step's own copy of a host tensor would make the host wait for the device's queue. (A meta
    device stands for the GPU: a host tensor left behind is on the CPU.)"""
    from mimo_train.training.step import ForwardStep
    from mimo_train.training.trainer import Trainer
    device = torch.device("meta")
    infra = SimpleNamespace(layout=Layout.parse("language=tp2,cp2"),
                            role=SimpleNamespace(modules=[]))
    balance = SimpleNamespace(tokens=None)
    forward = ForwardStep(infra, device, balance=balance)
    forward(iter([_packed([3, 6])]), lambda **inputs: (inputs["input_ids"], None))
    assert balance.tokens.device == device and balance.tokens.shape == (1, 12)
    trainer = SimpleNamespace(
        forward=forward, micro_batches=1, preprocess=SimpleNamespace(seq_length=12),
        cfg=SimpleNamespace(train=SimpleNamespace(micro_batch_size=1)), pg_collection=None,
        communicator=None, schedule=lambda **kwargs: None, device=device, model=None)
    sums = Trainer._reports(trainer, None, True)
    assert sums.device == device and sums.dtype == torch.float64 and sums.shape == (2,)


def test_a_padded_batch_keeps_a_multiple_of_64_and_of_cp():
    """The columns kept are the longest sample's (in any row), rounded up to 64 and to cp (here
    3: 192)."""
    real = torch.zeros(2, 300, dtype=torch.bool)
    real[0, :70] = True
    batch = {"input_ids": torch.ones(2, 300, dtype=torch.long), "attention_mask": real,
             "labels": torch.zeros(2, 300, dtype=torch.long), "loss_mask": torch.zeros(2, 300),
             "position_ids": torch.zeros(2, 300, dtype=torch.long)}
    assert model_inputs(batch, _infra("language=cp3"), torch.device("cpu"))[
        "input_ids"].shape == (2, 192)
    assert model_inputs(batch, _infra("language=cp2"), torch.device("cpu"))[
        "input_ids"].shape == (2, 128)
    assert real_tokens(batch, 3).shape == (2, 192) and int(real_tokens(batch, 3).sum()) == 70
    # the longest sample in any row, not the first row's: a second row of 130 keeps 192 at cp1
    real[1, :130] = True
    assert model_inputs(batch, _infra("language=dp1"), torch.device("cpu"))[
        "input_ids"].shape == (2, 192)
    assert int(real_tokens(batch).sum()) == 200
