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
