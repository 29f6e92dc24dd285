"""mimo_train.mcore.grad_accumulation: megatron-core's DDP takes the small gradients (biases,
norms' weights) into its fp32 buffers in multi-tensor additions at the end of each backward
pass, not one ``add_`` a tensor. Against DDP with megatron-core's own hook on the same bf16
model and micro-batches, in process (a one-rank gloo world): every buffer bit for bit equal
after two micro-batches, with megatron-core's reentrant recompute (an inner backward pass a
layer) and without, and the operators the backward passes dispatch: one ``add_`` fewer for
each small tensor and micro-batch, one ``_foreach_add_`` a backward pass.

mimo_train.mcore.wgrad_fusion: with ``gradient_accumulation_fusion`` the linear layers' weight
gradients are made into the buffers by their GEMMs (one ``addmm_`` a weight and micro-batch
instead of megatron-core's matmul and DDP's ``add_``): the same buffers as without it, in fp32
within its rounding, with tied embeddings (their gradient through DDP's hook, from the lookup
and mimo's loss) and recompute; the encoders' ``torch.nn.Linear`` layers made ``WgradLinear``
alike (a frozen one as ``torch.nn.Linear``); ``accumulate`` sums bf16 products in fp32,
unrounded."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch
import torch.utils.checkpoint
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


def _ddp(groups, megatrons: bool, recompute: bool, fusion: bool = False,
         dtype: torch.dtype = torch.bfloat16, tied: bool = False):
    """Two layers with biases in megatron-core's DDP (fp32 buffers, as mimo builds it);
    ``megatrons``: its hooks made by megatron-core's own method; ``fusion``: its
    ``gradient_accumulation_fusion`` (``mcore.wgrad_fusion``)."""
    from mimo_train.mcore import (DistributedDataParallel, DistributedDataParallelConfig,
                                  TransformerConfig, grad_accumulation)
    from mimo_train.mcore.layer_specs import language_block_spec
    from mimo_train.model.build import _SeededGPTModel

    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2,
        normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=True,
        activation_func=torch.nn.functional.silu, use_cpu_initialization=True,
        calculate_per_token_loss=True, attention_dropout=0.0, hidden_dropout=0.0,
        gradient_accumulation_fusion=fusion, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, bias_activation_fusion=False,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
        **({"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1} if recompute else {}))
    model = _SeededGPTModel(
        seed=1, vocabulary=ROWS, packed_rows=False, config=config,
        transformer_layer_spec=language_block_spec(config, backend="local"), vocab_size=ROWS,
        max_sequence_length=64, position_embedding_type="rope",
        share_embeddings_and_output_weights=tied, pg_collection=groups).to(dtype)
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


@pytest.mark.parametrize("tied, recompute", [(False, False), (True, True)],
                         ids=["untied", "tied-recomputed"])
def test_weight_gradients_made_into_the_buffers_by_their_gemms(groups, tied, recompute):
    theirs = _ddp(groups, True, recompute, dtype=torch.float32, tied=tied)
    ours = _ddp(groups, True, recompute, fusion=True, dtype=torch.float32, tied=tied)
    ours.module.load_state_dict(theirs.module.state_dict())
    expected, found = _micro_batches(theirs), _micro_batches(ours)
    assert theirs.buffers[0].grad_data.abs().sum() > 0
    torch.testing.assert_close(ours.buffers[0].grad_data, theirs.buffers[0].grad_data,
                               rtol=1e-5, atol=1e-6)
    # each layer's four linear weights, two micro-batches: a GEMM into the buffer each, no
    # matmul beside it and no addition by the hook (the output layer's weight, tied or not,
    # gets its gradient from mcore.language_loss, through the hook)
    fused = 2 * 2 * 4
    assert (expected["addmm_"], found["addmm_"]) == (0, fused)
    assert expected["add_"] - found["add_"] == fused
    assert expected["mm"] - found["mm"] == fused


def test_fused_weight_gradients_sum_bf16_products_unrounded():
    from mimo_train.mcore import wgrad_fusion

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 24, generator=generator).to(torch.bfloat16)
    outputs = torch.randn(64, 16, generator=generator).to(torch.bfloat16)
    start = torch.randn(16, 24, generator=generator)
    exact = start.double() + outputs.double().t() @ inputs.double()
    fused, unfused = start.clone(), start + (outputs.t() @ inputs).float()
    wgrad_fusion.accumulate(inputs, outputs, fused)
    assert (fused.double() - exact).abs().max() < 1e-5
    assert (unfused.double() - exact).abs().max() > 1e-3            # the bf16 rounding
    assert wgrad_fusion.supported("cpu")


def _encoder(groups, fused: bool, frozen: bool):
    """A tower-like fp32 stack of linear layers with biases (3-D rows, as CLIP's) in
    megatron-core's DDP, its first layer frozen if ``frozen``; ``fused``: made ``WgradLinear``
    (``mcore.wgrad_fusion.fuse_linears``, as ``model.build`` does to the encoders)."""
    from mimo_train.mcore import DistributedDataParallel, DistributedDataParallelConfig, \
        TransformerConfig, grad_accumulation, wgrad_fusion

    torch.manual_seed(3)
    stack = torch.nn.Sequential(torch.nn.Linear(HIDDEN, FFN), torch.nn.GELU(),
                                torch.nn.Linear(FFN, HIDDEN), torch.nn.Linear(HIDDEN, 8))
    stack[0].requires_grad_(not frozen)
    if fused:
        assert wgrad_fusion.fuse_linears(stack) == 3
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2)
    with mock.patch.object(grad_accumulation, "SMALL", 0):     # an add_ a tensor, countable
        return DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True), stack, pg_collection=groups)


@pytest.mark.parametrize("frozen, recompute", [(False, False), (True, False), (False, True)],
                         ids=["trained", "first-frozen", "recomputed"])
def test_encoder_linears_make_their_weight_gradients_into_the_buffers(groups, frozen,
                                                                      recompute):
    """``recompute``: under torch's non-reentrant checkpoint, as transformers' gradient
    checkpointing runs a tower (its saved weights come back detached)."""
    theirs, ours = _encoder(groups, False, frozen), _encoder(groups, True, frozen)
    generator = torch.Generator().manual_seed(1)
    micro_batches = [torch.randn(2, 5, HIDDEN, generator=generator) for _ in range(2)]
    found: list[Counter] = []
    for ddp in (theirs, ours):
        ddp.zero_grad_buffer()
        counts: Counter = Counter()
        for rows in micro_batches:
            loss = (torch.utils.checkpoint.checkpoint(ddp, rows, use_reentrant=False)
                    if recompute else ddp(rows)).square().sum()
            with Operators() as operators:
                loss.backward()
            counts += operators.counts
        found.append(counts)
    assert theirs.buffers[0].grad_data.abs().sum() > 0
    torch.testing.assert_close(ours.buffers[0].grad_data, theirs.buffers[0].grad_data,
                               rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in ours.parameters())
    trained = 2 if frozen else 3               # a GEMM into the buffer a trained weight
    assert found[1]["addmm_"] == 2 * trained and found[0]["addmm_"] == 0
    assert found[0]["add_"] - found[1]["add_"] == 2 * trained
    # the weights' matmuls gone, no input gradient made for the rows (as torch.nn.Linear)
    assert found[0]["mm"] - found[1]["mm"] == 2 * trained
    with torch.no_grad():                      # evaluation: torch.nn.Linear's own forward
        with Operators() as operators:
            ours(torch.randn(2, 5, HIDDEN))
    assert operators.counts["addmm"] + operators.counts["linear"] >= 1


def test_a_weight_another_module_holds_stays_unfused():
    """Its gradient made into the buffer would drop the other use's (DDP's hook skips a weight
    whose gradient was made there): a tied pair keeps torch.nn.Linear."""
    from mimo_train.mcore import wgrad_fusion

    stack = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 8))
    stack[2].weight = stack[1].weight
    assert wgrad_fusion.fuse_linears(stack) == 1
    assert [type(m).__name__ for m in stack] == ["WgradLinear", "Linear", "Linear"]
