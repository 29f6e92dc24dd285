"""mimo_train.mcore.grad_accumulation: megatron-core's DDP takes the small gradients (biases,
norms' weights) into its fp32 buffers in multi-tensor additions at the end of each backward
pass, not one ``add_`` a tensor. Against DDP with megatron-core's own hook on the same bf16
model and micro-batches, in process (a one-rank gloo world): every buffer bit for bit equal
after two micro-batches, with megatron-core's reentrant recompute (an inner backward pass a
layer) and without, and the operators the backward passes dispatch: one ``add_`` fewer for
each small tensor and micro-batch, one ``_foreach_add_`` a backward pass."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HIDDEN, FFN, ROWS, TOKENS, BATCH = 32, 48, 64, 10, 2
SMALL = 1000


@pytest.fixture(scope="module")
def groups():
    from mimo_data.loading.layout import Layout
    from mimo_train.mcore import ensure_global_memory_buffer
    from mimo_train.mcore.grids import build_infra
    from mimo_train.runtime import distributed

    with distributed.alone():
        ensure_global_memory_buffer()
        yield build_infra(Layout.parse("language=dp1"), "gloo").modules["language"].pgs


class Operators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _ddp(groups, megatrons: bool, recompute: bool):
    """Two bf16 layers with biases in megatron-core's DDP (fp32 buffers, as mimo builds it);
    ``megatrons``: its hooks made by megatron-core's own method."""
    from mimo_train.mcore import (DistributedDataParallel, DistributedDataParallelConfig,
                                  TransformerConfig, grad_accumulation)
    from mimo_train.mcore.layer_specs import language_block_spec
    from mimo_train.model.build import _SeededGPTModel

    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2,
        normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=True,
        activation_func=torch.nn.functional.silu, use_cpu_initialization=True,
        calculate_per_token_loss=True, attention_dropout=0.0, hidden_dropout=0.0,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, bias_activation_fusion=False,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        params_dtype=torch.bfloat16, bf16=True,
        **({"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1} if recompute else {}))
    model = _SeededGPTModel(
        seed=1, vocabulary=ROWS, packed_rows=False, config=config,
        transformer_layer_spec=language_block_spec(config, backend="local"), vocab_size=ROWS,
        max_sequence_length=64, position_embedding_type="rope",
        share_embeddings_and_output_weights=False, pg_collection=groups).to(torch.bfloat16)
    hooks = grad_accumulation.MEGATRON_HOOK if megatrons else grad_accumulation._batched_hook
    # at these widths every tensor would be small: the weights are not at SMALL 1,000
    with mock.patch.object(DistributedDataParallel, "_make_backward_post_hook", hooks), \
            mock.patch.object(grad_accumulation, "SMALL", SMALL):
        return DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model,
            pg_collection=groups)


def _micro_batches(ddp) -> Counter:
    """Two micro-batches' forward and backward passes into the zeroed buffers; the operators
    their backward passes dispatched."""
    ddp.zero_grad_buffer()
    generator = torch.Generator().manual_seed(0)
    counts: Counter = Counter()
    for _ in range(2):
        ids = torch.randint(0, ROWS, (BATCH, TOKENS), generator=generator)
        labels = torch.randint(0, ROWS, (BATCH, TOKENS), generator=generator)
        loss = ddp(input_ids=ids, position_ids=torch.arange(TOKENS).expand(BATCH, -1),
                   attention_mask=None, labels=labels).float().sum()
        with Operators() as operators:
            loss.backward()
        counts += operators.counts
    return counts


def test_importing_mimo_train_mcore_puts_the_hook_in_place():
    from mimo_train.mcore import DistributedDataParallel, grad_accumulation
    assert DistributedDataParallel._make_backward_post_hook is grad_accumulation._batched_hook


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_small_gradients_reach_the_buffers_in_one_addition_a_pass(groups, recompute):
    theirs, ours = _ddp(groups, True, recompute), _ddp(groups, False, recompute)
    ours.module.load_state_dict(theirs.module.state_dict())
    expected, found = _micro_batches(theirs), _micro_batches(ours)
    assert len(ours.buffers) == len(theirs.buffers) == 1
    assert ours.buffers[0].grad_data.dtype == torch.float32
    assert theirs.buffers[0].grad_data.abs().sum() > 0
    assert torch.equal(ours.buffers[0].grad_data, theirs.buffers[0].grad_data)
    assert all(p.grad is None for p in ours.parameters())
    small = [n for n, p in ours.module.named_parameters() if p.numel() <= SMALL]
    # each layer's two norms and four biases (qkv, proj, fc1, fc2), the final norm; not the
    # embedding, the output layer and the layers' four weights each (1,024 to 3,072 values)
    assert len(small) == 13 and sum(1 for _ in ours.parameters()) == 23, small
    # one addition a backward pass: with the layers recomputed, each layer's inner pass adds
    # its own (megatron-core's reentrant recompute), then the outer pass the rest
    assert expected["_foreach_add_"] == 0
    assert found["_foreach_add_"] == 2 * (1 + (2 if recompute else 0))
    assert expected["add_"] - found["add_"] == 2 * len(small)
