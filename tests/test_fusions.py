"""The fused elementwise regions of mimo's language model against the unfused computation
they replace, on the CPU (what runs there is the same code: on a GPU it is compiled or one
kernel), in process: megatron-core's fused SwiGLU (``bias_activation_fusion``, on for a gated
SiLU MLP: its own backward from the first matmul's output alone) against the unfused MLP of
the same weights, a whole one-layer model's loss and every gradient, fp32 and bf16; what it
keeps for the backward pass; Qwen3.5's zero-centred RMSNorm (torch's ``rms_norm``) against
transformers' ``Qwen3_5RMSNorm``. Tolerances: fp32 to 1e-6 relative (the same operations in
another order), bf16 within its rounding. The whole language models' parity with transformers
(``test_hf_language.py``, ``test_vlm*.py``) runs the fused path too."""

from __future__ import annotations

import pytest
import torch

from conftest import symbolic_sizes

HIDDEN, FFN, ROWS, TOKENS, BATCH = 32, 48, 64, 10, 2


@pytest.fixture(scope="module")
def groups():
    from mimo_data.loading.layout import Layout
    from mimo_train.mcore import ensure_global_memory_buffer
    from mimo_train.mcore.grids import build_infra
    from mimo_train.runtime import distributed

    with distributed.alone():
        ensure_global_memory_buffer()
        yield build_infra(Layout.parse("language=dp1"), "gloo").modules["language"].pgs


def _model(groups, fused: bool, dtype=torch.float32):
    from mimo_train.mcore import TransformerConfig
    from mimo_train.mcore.layer_specs import language_block_spec
    from mimo_train.model.build import _SeededGPTModel

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2,
        normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        use_cpu_initialization=True, calculate_per_token_loss=True, attention_dropout=0.0,
        hidden_dropout=0.0, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, bias_activation_fusion=fused,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall", params_dtype=dtype,
        bf16=dtype == torch.bfloat16)
    return _SeededGPTModel(
        seed=1, vocabulary=ROWS, packed_rows=False, config=config,
        transformer_layer_spec=language_block_spec(config, backend="local"), vocab_size=ROWS,
        max_sequence_length=64, position_embedding_type="rope",
        share_embeddings_and_output_weights=False, pg_collection=groups).to(dtype)


def _step(model):
    """The summed loss of one batch and every parameter's gradient."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ROWS, (BATCH, TOKENS), generator=generator)
    labels = torch.randint(0, ROWS, (BATCH, TOKENS), generator=generator)
    model.zero_grad()
    loss = model(input_ids=ids, position_ids=torch.arange(TOKENS).expand(BATCH, -1),
                 attention_mask=None, labels=labels).float().sum()
    loss.backward()
    return loss.detach(), {name: p.grad.float() for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_swiglu_trains_as_the_unfused_mlp(groups, dtype):
    unfused, fused = _model(groups, False, dtype), _model(groups, True, dtype)
    fused.load_state_dict(unfused.state_dict())
    assert fused.decoder.layers[0].mlp.config.bias_activation_fusion
    expected_loss, expected = _step(unfused)
    loss, found = _step(fused)
    # fp32: measured equal to 1e-7 of each gradient's largest entry; bf16: the loss equal, the
    # gradients within 1e-2 of their largest entry (bf16's epsilon is 3.9e-3)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(loss, expected_loss, rtol=tolerance, atol=0)
    assert found.keys() == expected.keys()
    for name, grad in expected.items():
        assert grad.abs().max() > 0, name
        assert (found[name] - grad).abs().max() <= tolerance * grad.abs().max(), name


def test_the_fused_swiglu_keeps_less_for_the_backward_pass(groups):
    """What autograd saves in one forward pass: the fused MLP keeps the first matmul's output
    [T, 2f] for its own backward, not also the SiLU's input and output and the gate product's
    operands (the unfused 4·T·f floats more, here 4 · 20 · 48 · 4 bytes = 15360)."""
    sizes = {}
    for fused in (False, True):
        model = _model(groups, fused)
        saved: dict[int, int] = {}

        def pack(tensor, saved=saved):
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        ids = torch.zeros(BATCH, TOKENS, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(input_ids=ids, position_ids=torch.arange(TOKENS).expand(BATCH, -1),
                  attention_mask=None, labels=ids)
        sizes[fused] = sum(saved.values())
    assert sizes[False] - sizes[True] >= 2 * BATCH * TOKENS * FFN * 4, sizes


def test_the_zero_centred_norm_is_transformers_qwen3_5_norm():
    """Qwen3.5's norms (``1 + weight``, in fp32) through torch's ``rms_norm``: transformers'
    ``Qwen3_5RMSNorm`` on the same weights, values and gradients, fp32 and bf16 inputs."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from mimo_train.mcore.norms import ZeroCenteredRMSNorm
    generator = torch.Generator().manual_seed(0)
    ours, theirs = ZeroCenteredRMSNorm(HIDDEN, 1e-6), hf.Qwen3_5RMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(HIDDEN, generator=generator) * 0.1)
        theirs.weight.copy_(ours.weight)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(TOKENS, HIDDEN, generator=generator) * 3).to(dtype)
        outputs, grads = [], []
        for norm in (ours, theirs):
            norm.zero_grad()
            given = x.clone().requires_grad_()
            out = norm(given)
            (out.float() * torch.arange(HIDDEN)).sum().backward()
            outputs.append(out)
            grads.append((given.grad, norm.weight.grad.clone()))
        assert outputs[0].dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-6, atol=1e-6)
            for a, b in zip(*grads):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:       # the same fp32 values rounded once: at most one bf16 step apart
            assert (outputs[0].float() - outputs[1].float()).abs().max() <= \
                2 ** -7 * outputs[1].float().abs().max()


# ------------------------------------------------------------------ the attention's rotary

def _rotary_inputs(dtype, rotated: int, heads: int = 6, groups: int = 2, dim: int = 16,
                   tokens: int = 9, batch: int = 3):
    """The fused QKV output (the leaf), and the queries and keys cut from it as megatron-core's
    attention cuts them (``get_query_key_value_tensors``: a view per key-value group, split
    along its channels; the queries reshaped, so contiguous, the keys a strided view),
    ``[s, b, heads, d]``; an M-RoPE-shaped table ``[s, b, 1, rotated]``."""
    generator = torch.Generator().manual_seed(0)
    per_group = heads // groups
    qkv = (torch.randn(tokens, batch, groups * (per_group + 2) * dim, generator=generator) * 2
           ).to(dtype).requires_grad_()
    mixed = qkv.view(tokens, batch, groups, (per_group + 2) * dim)
    query, key, _ = torch.split(mixed, [per_group * dim, dim, dim], dim=3)
    query = query.reshape(tokens, batch, -1, dim)
    freqs = torch.randn(tokens, batch, 1, rotated, generator=generator) * 4
    return qkv, query, key, freqs


@pytest.mark.parametrize("dtype, rotated, mscale", [
    (torch.float32, 16, 1.0), (torch.bfloat16, 16, 1.0), (torch.bfloat16, 8, 0.7)],
    ids=["fp32", "bf16", "bf16-partial-scaled"])
def test_the_fused_rotary_is_megatron_cores_bit_for_bit(dtype, rotated, mscale):
    """``mcore.rope_fusion``'s rotary (one formula forward, one backward; as written on the
    CPU) against megatron-core's unfused ``_apply_rotary_pos_emb_bshd`` on the same views of
    a QKV output: rows and the QKV gradient equal bit for bit, a partial rotary (Qwen3.5
    rotates a quarter of each head) and a scale included."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from mimo_train.mcore.rope_fusion import fused_rope
    results = []
    for apply in (fused_rope, _apply_rotary_pos_emb_bshd):
        qkv, query, key, freqs = _rotary_inputs(dtype, rotated)
        rows = [apply(t, freqs, mscale=mscale) for t in (query, key)]
        weights = torch.arange(rows[0].shape[-1], dtype=dtype)
        sum((r * weights).float().sum() for r in rows).backward()
        results.append((rows, qkv.grad))
    (rows, grad), (expected_rows, expected_grad) = results
    for found, expected in zip(rows, expected_rows):
        assert found.dtype == dtype and torch.equal(found, expected)
    assert torch.equal(grad, expected_grad) and grad.abs().max() > 0


def test_the_language_model_takes_the_fused_rotary(groups, monkeypatch):
    """megatron-core's attention applies its rotary through ``rope_fusion`` (installed when
    ``mimo_train.mcore`` is imported): twice a layer, queries and keys, and a whole one-layer
    model's loss and gradients are the unfused rotary's bit for bit; a packed THD batch (its
    boundaries given) stays on megatron-core's own."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    from mimo_train import mcore
    from mimo_train.mcore import rope_fusion
    assert mcore.ROPE_FUSION is True
    assert attention.apply_rotary_pos_emb is not rope_utils.apply_rotary_pos_emb
    calls = []
    fused = rope_fusion.fused_rope
    monkeypatch.setattr(rope_fusion, "fused_rope",
                        lambda *args: calls.append(args[0].shape) or fused(*args))
    model = _model(groups, True, torch.bfloat16)
    loss, grads = _step(model)
    assert len(calls) == 2 and calls[0][2] == 2          # queries and keys, 2 heads each
    with monkeypatch.context() as unfused:
        unfused.setattr(attention, "apply_rotary_pos_emb", rope_utils.apply_rotary_pos_emb)
        expected_loss, expected = _step(model)
    assert len(calls) == 2 and torch.equal(loss, expected_loss)
    assert all(torch.equal(grads[name], grad) for name, grad in expected.items())
    t, freqs = torch.randn(TOKENS, 2, 8), torch.randn(TOKENS, 1, 1, 8)
    packed = attention.apply_rotary_pos_emb(
        t, freqs, model.config, cu_seqlens=torch.tensor([0, 4, TOKENS], dtype=torch.int32),
        cp_group=groups.cp)
    assert len(calls) == 2 and packed.shape == t.shape


def test_the_fused_rotary_compiles_once_for_queries_and_once_for_keys(monkeypatch):
    """The compiled path (dynamo's tracing here; inductor's kernels on a GPU) on packed rows
    (batch 1) as megatron-core's attention cuts them: two sequence lengths, training and
    no-grad passes make two graphs of each formula, the queries' (their heads) and the keys'
    (their groups: heads and widths are constants of the graphs, the length alone dynamic),
    and the rows are the formula's as written."""
    from mimo_train.mcore import rope_fusion
    from mimo_train.runtime.compile import Compiler
    graphs: list = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward
    monkeypatch.setattr(rope_fusion, "COMPILER", Compiler(backend=backend, devices=("cpu",)))
    for tokens, train in ((9, True), (13, True), (9, False)):
        qkv, query, key, freqs = _rotary_inputs(torch.bfloat16, 16, tokens=tokens, batch=1)
        with torch.set_grad_enabled(train):
            rows = [rope_fusion.fused_rope(t, freqs) for t in (query, key)]
            if train:
                sum(r.float().sum() for r in rows).backward()
        assert torch.equal(rows[1], rope_fusion.rope(key.detach(), freqs, 1.0))
    assert {f.__name__ for f in rope_fusion.COMPILER.compiled} == {"rope", "rope_backward"}
    assert len(graphs) == 4, [graph.code for graph in graphs]
    for graph in graphs:      # heads and widths compiled in: no index divided at run time
        assert symbolic_sizes(graph) == {0}, graph.code
