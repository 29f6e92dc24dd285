"""mimo_train/mcore/delta_rule.py: Qwen3.5's gated delta-net (linear attention) kernels exact
per sample when sequences are packed, on the CPU; expected values from transformers' Qwen3.5
code, never from the code under test.

- the torch chunked rule equals transformers' token-by-token recurrence
  (``torch_recurrent_gated_delta_rule``, an independent formulation) on each sample, grouped
  value heads, sample lengths off the chunk size (1, 5, 64, 70, 130), with and without initial
  states, final states included; the causal convolution equals transformers' on each sample,
  its final window transformers' cached decode state;
- packed = each sample alone (transformers' functions, which are right on one sequence), outputs
  and every input's gradient, for the convolution and the rule; and with the reset broken (the
  packed row run as one sequence, as transformers' and megatron-core's torch fallbacks do) the
  same check sees the leak.

All in this process, fp32, within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from mimo_train.mcore import delta_rule

LENGTHS = [1, 5, 64, 70, 130]          # off the chunk size (64) but one
KEY_HEADS, VALUE_HEADS, K_DIM, V_DIM = 2, 4, 8, 6        # grouped value heads: 2 per q/k head
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _bounds(lengths):
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return bounds


def _samples(bounds):
    return list(zip(bounds, bounds[1:]))


def _rule_inputs(tokens, seed=0, batch=1):
    """q, k, v, g (log decay), beta, as a GDN layer makes them, leaves for gradients."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)
    inputs = (randn(batch, tokens, KEY_HEADS, K_DIM), randn(batch, tokens, KEY_HEADS, K_DIM),
              randn(batch, tokens, VALUE_HEADS, V_DIM),
              F.logsigmoid(randn(batch, tokens, VALUE_HEADS) + 2),     # decays near 0.9
              randn(batch, tokens, VALUE_HEADS).sigmoid())
    return [t.requires_grad_() for t in inputs]


# ------------------------------------------------------------------------------ the kernels

@pytest.mark.parametrize("with_initial_state", [False, True])
def test_rule_equals_the_token_by_token_recurrence(with_initial_state):
    bounds = _bounds(LENGTHS)
    q, k, v, g, beta = _rule_inputs(bounds[-1])
    states = torch.randn(len(LENGTHS), VALUE_HEADS, K_DIM, V_DIM) if with_initial_state else None
    out, final = delta_rule.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=states, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
    assert out.shape == v.shape and final.shape == (len(LENGTHS), VALUE_HEADS, K_DIM, V_DIM)
    for n, (start, end) in enumerate(_samples(bounds)):
        expected, expected_final = hf.torch_recurrent_gated_delta_rule(
            *(t[:, start:end] for t in (q, k, v, g, beta)),
            initial_state=None if states is None else states[n:n + 1],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[:, start:end], expected, **TOL)
        torch.testing.assert_close(final[n:n + 1], expected_final, **TOL)


def test_rule_unpacked_rows_are_sequences():
    """Without ``cu_seqlens`` each row of the batch is one sequence (its own state)."""
    q, k, v, g, beta = _rule_inputs(70, seed=1, batch=2)
    out, final = delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    expected, expected_final = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(final, expected_final, **TOL)


def test_conv_equals_transformers_per_sample():
    """Outputs against transformers' convolution on each sample; with initial windows, against
    its cached decode (``causal_conv1d_update``), whose cache is fla's final-state layout."""
    generator = torch.Generator().manual_seed(2)
    lengths = [1, 5, 2, 0, 9]                          # an empty sample keeps its window
    bounds = _bounds(lengths)
    dim, width = 6, 4
    x = torch.randn(1, bounds[-1], dim, generator=generator)
    weight = torch.randn(dim, width, generator=generator)
    bias = torch.randn(dim, generator=generator)
    windows = torch.randn(len(lengths), dim, width, generator=generator)
    cu = torch.tensor(bounds)
    out, final = delta_rule.causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=cu,
                                          output_final_state=True)
    primed, primed_final = delta_rule.causal_conv1d(
        x, weight, bias, activation="silu", cu_seqlens=cu, initial_state=windows,
        output_final_state=True)
    for n, (start, end) in enumerate(_samples(bounds)):
        rows = x[:, start:end].transpose(1, 2)
        state, primed_state = torch.zeros(1, dim, width), windows[n:n + 1].clone()
        if end > start:
            expected = hf.causal_conv1d_fn(rows, weight, bias, activation="silu")
            torch.testing.assert_close(out[:, start:end], expected.transpose(1, 2), **TOL)
            hf.causal_conv1d_update(rows, state, weight, bias, "silu")
            expected = hf.causal_conv1d_update(rows, primed_state, weight, bias, "silu")
            torch.testing.assert_close(primed[:, start:end], expected.transpose(1, 2), **TOL)
        torch.testing.assert_close(final[n:n + 1], state, **TOL)
        torch.testing.assert_close(primed_final[n:n + 1], primed_state, **TOL)


# ------------------------------------------------------------- packed = each sample alone

def _conv_case(seed=3):
    generator = torch.Generator().manual_seed(seed)
    bounds = _bounds(LENGTHS)
    dim, width = 10, 4
    inputs = [torch.randn(1, bounds[-1], dim, generator=generator),
              torch.randn(dim, width, generator=generator), torch.randn(dim, generator=generator)]
    inputs = [t.requires_grad_() for t in inputs]

    def packed(x, weight, bias, cu_seqlens):
        return delta_rule.causal_conv1d(x, weight, bias, activation="silu",
                                        cu_seqlens=cu_seqlens)[0]

    def one_sequence(x, weight, bias, cu_seqlens):      # transformers', boundaries dropped
        return hf.causal_conv1d_fn(x.transpose(1, 2), weight, bias,
                                   activation="silu").transpose(1, 2)

    def alone(x, weight, bias, start, end):
        return one_sequence(x[:, start:end], weight, bias, None)
    return bounds, inputs, packed, one_sequence, alone


def _rule_case(seed=4):
    bounds = _bounds(LENGTHS)
    states = torch.randn(len(LENGTHS), VALUE_HEADS, K_DIM, V_DIM,
                         generator=torch.Generator().manual_seed(seed)).requires_grad_()
    inputs = [*_rule_inputs(bounds[-1], seed=seed), states]

    def packed(q, k, v, g, beta, states, cu_seqlens):      # one sequence: the first state
        return delta_rule.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=states if cu_seqlens is not None else states[:1],
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)[0]

    def one_sequence(q, k, v, g, beta, states, cu_seqlens):   # transformers', boundaries dropped
        return hf.torch_chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=states[:1], use_qk_l2norm_in_kernel=True)[0]

    def alone(q, k, v, g, beta, states, start, end):
        n = bounds.index(start)
        return hf.torch_chunk_gated_delta_rule(
            *(t[:, start:end] for t in (q, k, v, g, beta)), initial_state=states[n:n + 1],
            use_qk_l2norm_in_kernel=True)[0]
    return bounds, inputs, packed, one_sequence, alone


CASES = {"conv": _conv_case, "rule": _rule_case}


def _gradients(output, inputs, probe):
    return torch.autograd.grad((output * probe).sum(), inputs, allow_unused=True)


def _packed_vs_alone(bounds, inputs, run, alone) -> float:
    """The largest difference between the packed row (``run``) and each sample alone, over the
    outputs and every input's gradient (of a fixed random probe of the outputs); the gradients
    of what all samples share (weights) against the sum over the samples."""
    cu = torch.tensor(bounds, dtype=torch.int32)
    out = run(*inputs, cu)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    grads = _gradients(out, inputs, probe)
    expected_out = torch.cat([alone(*inputs, start, end) for start, end in _samples(bounds)], 1)
    expected_grads = _gradients(expected_out, inputs, probe)
    worst = (out - expected_out).abs().max().item()
    for grad, expected in zip(grads, expected_grads):
        worst = max(worst, (grad - expected).abs().max().item())
    return worst


@pytest.mark.parametrize("kernel", sorted(CASES))
def test_packed_equals_each_sample_alone(kernel):
    bounds, inputs, packed, _, alone = CASES[kernel]()
    assert _packed_vs_alone(bounds, inputs, packed, alone) < 1e-5


@pytest.mark.parametrize("kernel", sorted(CASES))
def test_a_leaking_state_shows(kernel):
    """The packed row run as one sequence, by transformers' torch functions (its Qwen3.5 layer's
    convolution drops the boundaries so; its rule refuses them) or by this module's kernels
    without ``cu_seqlens``: state or window leaks from each sample into the next, and the check
    above sees it."""
    bounds, inputs, packed, one_sequence, alone = CASES[kernel]()
    assert _packed_vs_alone(bounds, inputs, one_sequence, alone) > 1e-2
    leaking = lambda *args: packed(*args[:-1], None)             # noqa: E731
    assert _packed_vs_alone(bounds, inputs, leaking, alone) > 1e-2


def test_l2norm_is_fla_s():
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(delta_rule.l2norm(x), hf.l2norm(x, dim=-1, eps=1e-6), **TOL)
    assert delta_rule.l2norm(x.double(), output_dtype=torch.float32).dtype == torch.float32


def test_fla_serves_only_cuda_tensors():
    assert not delta_rule.fla_serves(torch.zeros(1))           # CPU: always the torch kernels
