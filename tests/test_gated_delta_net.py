"""mimo_train/mcore/delta_rule.py and gated_delta_net.py: Qwen3.5's gated delta-net (linear
attention) exact per sample when sequences are packed, on the CPU; expected values from
transformers' Qwen3.5 code, never from the code under test.

- the torch chunked rule equals transformers' token-by-token recurrence
  (``torch_recurrent_gated_delta_rule``, an independent formulation) on each sample, grouped
  value heads, sample lengths off the chunk size (1, 5, 64, 70, 130), with and without initial
  states, final states included; the causal convolution equals transformers' on each sample,
  its final window transformers' cached decode state;
- packed = each sample alone (transformers' functions, which are right on one sequence), outputs
  and every input's gradient, for the convolution and the rule; and with the reset broken (the
  packed row run as one sequence, as transformers' and megatron-core's torch fallbacks do) the
  same check sees the leak;
- megatron-core's ``GatedDeltaNet``: each of ``gated_delta_net``'s patches, what fails without
  it, then the layer with it; the layer, its weights mapped from a transformers
  ``Qwen3_5GatedDeltaNet`` of a small ``Qwen3_5TextConfig``, equals transformers' on a sample
  (output, gradients); a packed row through its ``PackedSeqParams`` (THD, and mimo's one sbhd
  row) equals each sample alone, forward and gradients, where megatron-core's own layer leaks
  on the sbhd row.

All in this process (a one-rank gloo world for megatron-core), fp32, within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from mimo_train.mcore import delta_rule
from mimo_train.mcore import gated_delta_net as gdn_patches

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


@pytest.mark.parametrize("hopper, triton_3_4, triton_3_7_1, tilelang, refused", [
    (True, True, False, False, True),       # the H200 of the GPU check: torch 2.11's Triton
    (True, True, False, True, False),       # fla's tilelang backend takes the kernel
    (True, True, True, False, False),       # Triton 3.7.1+: fixed
    (False, True, False, False, False),     # not Hopper
])
def test_fla_is_not_used_where_it_refuses_its_backward(monkeypatch, capsys, hopper, triton_3_4,
                                                       triton_3_7_1, tilelang, refused):
    """fla 0.6 raises in the gated delta rule's first backward pass on Hopper with Triton 3.4
    to 3.7.0 (its issue #640): mimo takes its torch kernels there, and says why, instead of
    failing step 1; megatron-core's layer too (the ``kernels`` patch, needed on a GPU exactly
    where fla refuses: else the layer calls fla's own kernels). fla is not installed here: its
    modules and flags are stand-ins, and CUDA is said to be there."""
    from megatron.core.ssm.gated_delta_net import common
    import importlib.util
    import sys
    import types
    flags = types.ModuleType("fla.ops.common.chunk_o")
    flags.IS_NVIDIA_HOPPER, flags.TRITON_ABOVE_3_4_0, flags.TRITON_ABOVE_3_7_1 = \
        hopper, triton_3_4, triton_3_7_1
    modules = {"fla.modules.convolution": {"causal_conv1d": object()},
               "fla.modules.l2norm": {"l2norm": object()},
               "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": object()}}
    for name, values in modules.items():
        module = types.ModuleType(name)
        vars(module).update(values)
        monkeypatch.setitem(sys.modules, name, module)
    for name in ("fla", "fla.modules", "fla.ops", "fla.ops.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", flags)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if (
        name == "tilelang" and tilelang) else (None if name == "tilelang" else find_spec(name, *a)))
    monkeypatch.setattr(common, "HAVE_FLA", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    delta_rule._fla.cache_clear()
    try:
        kernels = delta_rule._fla()
        patched = gdn_patches.PATCHES["kernels"].needed()
    finally:
        delta_rule._fla.cache_clear()
    assert (kernels is None) == refused and patched == refused
    said = capsys.readouterr().out
    assert ("fla issue #640" in said and "triton>=3.7.1" in said) == refused, said


# ------------------------------------------------------------ megatron-core's GatedDeltaNet

HIDDEN = 32


def _text_config() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_conv_kernel_dim=4, linear_key_head_dim=K_DIM, linear_value_head_dim=V_DIM,
        linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS, rms_norm_eps=1e-6,
        layer_types=["linear_attention"] * 3 + ["full_attention"])


def megatron_config(text):
    """The ``TransformerConfig`` whose GatedDeltaNet is transformers' ``Qwen3_5GatedDeltaNet``
    of ``text`` (the decoder norms zero-centred, as Qwen3.5's: the gated norm ignores it)."""
    from mimo_train.mcore import TransformerConfig

    pattern = [int(kind == "linear_attention") for kind in text.layer_types]
    return TransformerConfig(
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads, normalization="RMSNorm",
        layernorm_epsilon=text.rms_norm_eps, layernorm_zero_centered_gamma=True,
        activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=pattern,
        linear_conv_kernel_dim=text.linear_conv_kernel_dim,
        linear_key_head_dim=text.linear_key_head_dim,
        linear_value_head_dim=text.linear_value_head_dim,
        linear_num_key_heads=text.linear_num_key_heads,
        linear_num_value_heads=text.linear_num_value_heads,
        use_cpu_initialization=True, perform_initialization=False, bias_dropout_fusion=False)


def mapped(tensors: dict[str, torch.Tensor], reference: hf.Qwen3_5GatedDeltaNet,
           rank: int = 0, size: int = 1) -> dict[str, torch.Tensor]:
    """transformers' ``Qwen3_5GatedDeltaNet`` tensors (its parameters, or their gradients) by
    megatron-core's names, as tensor-parallel rank ``rank`` of ``size`` holds them: the fused
    ``in_proj`` is the rank's part of each section in turn, [q, k, v, z, beta, alpha] (q, k by
    key heads, the rest by value heads); ``conv1d`` its part of q, k, v; ``A_log``,
    ``dt_bias`` its value heads; ``out_proj`` its input columns; the gated norm whole."""
    def part(tensor, dim=0):
        return tensor.chunk(size, dim)[rank]
    split = [reference.key_dim, reference.key_dim, reference.value_dim]
    q, k, v = tensors["in_proj_qkv.weight"].split(split)
    in_proj = [q, k, v, *(tensors[f"in_proj_{x}.weight"] for x in "zba")]
    return {"in_proj.weight": torch.cat([part(t) for t in in_proj]),
            "conv1d.weight": torch.cat([part(t) for t in tensors["conv1d.weight"].split(split)]),
            "A_log": part(tensors["A_log"]), "dt_bias": part(tensors["dt_bias"]),
            "out_norm.weight": tensors["norm.weight"],
            "out_proj.weight": part(tensors["out_proj.weight"], dim=1)}


def load_from_transformers(layer, reference: hf.Qwen3_5GatedDeltaNet, rank: int = 0,
                           size: int = 1) -> None:
    tensors = dict(reference.named_parameters())
    with torch.no_grad():
        for name, tensor in mapped(tensors, reference, rank, size).items():
            layer.get_parameter(name).copy_(tensor)


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo world and megatron-core's process groups for a layer (TP 1, CP 1)."""
    from mimo_train.mcore import ProcessGroupCollection
    from mimo_train.runtime import distributed

    with distributed.alone():
        group = dist.new_group([0])
        yield ProcessGroupCollection(tp=group, cp=group)


@pytest.fixture(scope="module")
def reference():
    """transformers' layer of the small config, its parameters all random (A_log, dt_bias and
    the gated norm's weight too: each mapping shows)."""
    torch.manual_seed(6)
    layer = hf.Qwen3_5GatedDeltaNet(_text_config(), layer_idx=0)
    with torch.no_grad():
        for name in ("dt_bias", "norm.weight"):
            layer.get_parameter(name).uniform_(0.5, 1.5)
    return layer


def _build(world, layer_class=None):
    from megatron.core.transformer.spec_utils import build_module

    spec = gdn_patches.module_spec()
    if layer_class is not None:
        spec.module = layer_class
    return build_module(spec, config=megatron_config(_text_config()), layer_number=1,
                        pg_collection=world)


@pytest.fixture(scope="module")
def layer(world, reference):
    built = _build(world)
    load_from_transformers(built, reference)
    return built


def _packed_params(bounds, qkv_format="thd"):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(end - start for start, end in _samples(bounds))
    # the key's boundaries another tensor of the same values, as mimo's collate makes them
    return PackedSeqParams(qkv_format=qkv_format, cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(),
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _hidden(tokens, seed=7):
    return torch.randn(tokens, 1, HIDDEN,
                       generator=torch.Generator().manual_seed(seed)).requires_grad_()


def test_every_patch_is_tested():
    tested = {name[len("test_patch_"):] for name in globals() if name.startswith("test_patch_")}
    assert set(gdn_patches.PATCHES) == tested
    assert all(patch.failure for patch in gdn_patches.PATCHES.values())
    if not torch.cuda.is_available():
        assert set(gdn_patches.APPLIED) == set(gdn_patches.PATCHES)     # the CPU needs it


def test_patch_contiguous_cut():
    """Under context parallelism megatron-core's layer takes its tokens in Transformer Engine's
    load-balanced order: its all-to-alls undo and redo that order, its packed-row permutation
    moves the tokens; under mimo's contiguous cut each would shuffle the sequence. With the
    patch the tokens keep their order through all three (the layer at cp2 against the
    colocated step, loss and every gradient: tests/test_qwen3_5.py)."""
    from megatron.core.ssm.gated_delta_net import common, gdn
    from megatron.core.ssm.mamba_context_parallel import _undo_attention_load_balancing
    tokens = torch.arange(16)
    cu = torch.tensor([0, 8, 16])
    moved, _ = common._build_thd_cp_a2a_perm(cu, 2, 16)            # megatron-core's own
    assert not torch.equal(moved, tokens)
    assert not torch.equal(_undo_attention_load_balancing(
        tokens[:, None, None].float(), 2).flatten(), tokens.float())
    kept, back = gdn._build_thd_cp_a2a_perm(cu, 2, 16)              # patched
    assert torch.equal(kept, tokens) and torch.equal(back, tokens)
    assert gdn.tensor_a2a_cp2hp.keywords == {"undo_attention_load_balancing": False}
    assert common.tensor_a2a_hp2cp.keywords == {"redo_attention_load_balancing": False}


def test_patch_quiet_slices():
    """megatron-core's ``get_parameter_local_cp`` indexes a parameter with a list of slices,
    which torch warns of on every rank under context parallelism; patched: the same slice of
    the parameter, and no warning."""
    import warnings

    from megatron.core.ssm.gated_delta_net import gdn

    class Group:                     # the second of two context-parallel ranks
        def rank(self):
            return 1

        def size(self):
            return 2
    param = torch.arange(8.0)
    with pytest.warns(UserWarning, match="non-tuple sequence for multidimensional indexing"):
        theirs = gdn_patches._LOCAL_CP(param, 0, Group())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = gdn.get_parameter_local_cp(param, 0, Group())
    assert torch.equal(ours, theirs) and torch.equal(ours, param[4:])


def test_patch_kernels(world, reference, monkeypatch):
    """Without fla, megatron-core's layer cannot be built (its fla check, then its kernel
    ``gated_delta_rule`` unset), nor run (no convolution, no l2norm); with the patch it is
    transformers' layer."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    monkeypatch.setattr(common, "HAVE_FLA", False)
    with pytest.raises(ImportError, match="FLA is not installed"):
        _build(world)
    monkeypatch.setattr(common, "HAVE_FLA", True)
    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", None)
    with pytest.raises(AssertionError, match="gated_delta_rule for GDN is not set"):
        _build(world)
    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", delta_rule.chunk_gated_delta_rule)
    for module, name in ((gdn, "causal_conv1d"), (common, "l2norm")):
        monkeypatch.setattr(module, name, None)
    with pytest.raises(TypeError, match="'NoneType' object is not callable"):
        _build(world)(_hidden(9), None)
    assert gdn_patches.activate(only=["kernels"], force=True) == ["kernels"]
    served = _build(world)
    load_from_transformers(served, reference)
    x = _hidden(9)
    out, bias = served(x, None)
    assert bias is None
    torch.testing.assert_close(out.transpose(0, 1), reference(x.transpose(0, 1)), **TOL)


def test_layer_equals_transformers(layer, reference):
    """Unpacked: output and the input's gradient equal transformers' layer (fp32), and the
    mapped weights' gradients equal the gradients of what they were mapped from."""
    x = _hidden(75)
    out, _ = layer(x, None)
    x_hf = x.detach().transpose(0, 1).requires_grad_()
    expected = reference(x_hf)
    torch.testing.assert_close(out.transpose(0, 1), expected, **TOL)
    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(8))
    layer.zero_grad()
    reference.zero_grad()
    (out.transpose(0, 1) * probe).sum().backward()
    (expected * probe).sum().backward()
    torch.testing.assert_close(x.grad.transpose(0, 1), x_hf.grad, **TOL)
    grads = {name: p.grad for name, p in reference.named_parameters()}
    expected_grads = mapped(grads, reference)
    assert set(expected_grads) == {name for name, _ in layer.named_parameters()}
    for name, expected_grad in expected_grads.items():
        torch.testing.assert_close(layer.get_parameter(name).grad, expected_grad, **TOL)


def _layer_packed_vs_alone(layer, params, bounds) -> float:
    """``_packed_vs_alone`` for a layer: the packed row through ``params`` against each sample
    alone, unpacked, output and gradients (the input's, every weight's)."""
    x = _hidden(bounds[-1], seed=10)
    weights = list(layer.parameters())
    out, _ = layer(x, None, packed_seq_params=params)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(11))
    grads = _gradients(out, [x, *weights], probe)
    expected_out = torch.cat([layer(x[start:end], None)[0] for start, end in _samples(bounds)])
    expected_grads = _gradients(expected_out, [x, *weights], probe)
    worst = (out - expected_out).abs().max().item()
    for grad, expected in zip(grads, expected_grads):
        worst = max(worst, ((grad - expected).abs() / (1 + expected.abs())).max().item())
    return worst


def test_layer_packed_equals_each_sample_alone(layer):
    bounds = _bounds(LENGTHS)
    assert _layer_packed_vs_alone(layer, _packed_params(bounds), bounds) < 1e-5


def test_layer_keeps_mimo_s_sbhd_rows_per_sample(world, reference, layer):
    """mimo's language model hands packed rows to its layers as one sbhd sequence
    (``mcore.attention``): megatron-core's own layer then runs the row as one sequence, state
    leaking; mimo's keeps each sample alone."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet

    bounds = _bounds([5, 64, 70])
    assert _layer_packed_vs_alone(layer, _packed_params(bounds, "sbhd"), bounds) < 1e-5
    plain = _build(world, MegatronGatedDeltaNet)
    load_from_transformers(plain, reference)
    assert _layer_packed_vs_alone(plain, _packed_params(bounds, "sbhd"), bounds) > 1e-2


def test_gated_norm_ignores_the_decoder_norms_settings():
    """Built from a config of zero-centred LayerNorms, the gated norm is still transformers'
    ``Qwen3_5RMSNormGated``'s norm: an RMS norm, weight ones, ``weight · x / rms(x)``."""
    from mimo_train.mcore import GatedNorm, TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               normalization="LayerNorm", layernorm_zero_centered_gamma=True)
    norm = GatedNorm(config, hidden_size=V_DIM, eps=1e-6)
    gated = hf.Qwen3_5RMSNormGated(V_DIM, eps=1e-6)
    assert torch.equal(norm.weight, gated.weight)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        gated.weight.copy_(norm.weight)
    x, z = torch.randn(2, 4, V_DIM), torch.randn(2, 4, V_DIM)
    torch.testing.assert_close(norm(x) * F.silu(z), gated(x, z), **TOL)


def test_a_packed_row_s_boundaries_are_read_once_for_every_layer(layer, monkeypatch):
    """Every gated delta-net layer of a packed micro-batch gets the same boundaries (the
    query's and the key's, two tensors): mimo's parts of the layer (megatron-core's check of
    the last boundary, the torch kernels' convolution and rule) read each on the host once,
    and wait for nothing else (on a GPU each read waits for the device), not at each layer;
    new boundaries (the next micro-batch) are read again. megatron-core's layer then compares
    the query's with the key's (``torch.equal``): it gets one tensor twice, which needs no
    read."""
    from mimo_train.runtime.profile import HostWaits

    def waits(params, layers: int) -> int:
        x = _hidden(_bounds([5, 64, 70])[-1])
        with HostWaits() as found:
            for _ in range(layers):
                layer(x, None, packed_seq_params=params)
        return sum(count for site, count in found.sites.items() if "mimo_train/mcore" in site)

    compared: list[bool] = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(a is b) or equal(a, b))
    params = _packed_params(_bounds([5, 64, 70]))
    assert waits(params, 1) == 2                 # the query's and the key's
    assert compared == [True], compared
    assert waits(params, 2) == 0                 # the same micro-batch's boundaries
    assert waits(_packed_params(_bounds([5, 64, 70])), 2) == 2
