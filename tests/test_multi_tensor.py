"""mimo_train.mcore.multi_tensor: megatron-core's gradient norm, clipping and main-weight copy
without TransformerEngine or apex, on torch's foreach kernels: the same values as
megatron-core's own fallbacks, without reading a device value on the host (checked on the
meta device, where any host read fails), and put in place by importing mimo_train.mcore."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mimo_train.mcore as mcore
from megatron.core import utils
from megatron.core.optimizer import clip_grads, optimizer
from mimo_train.mcore.multi_tensor import (MEGATRON_COPY, foreach_copy, foreach_l2_norm,
                                           foreach_scale)

NOOP = torch.zeros(1, dtype=torch.int)


class _Calls(TorchDispatchMode):
    """The operators dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _grads(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(7,), (64, 48), (3, 5, 11), (1,), (151, 9)]
    return [torch.randn(shape, generator=generator) * (i + 1) for i, shape in enumerate(shapes)]


def test_the_norm_is_megatron_cores_fallbacks():
    grads = _grads()
    ours, _ = foreach_l2_norm(2048, NOOP, [grads], False)
    theirs = torch.norm(torch.tensor([float(torch.norm(g)) for g in grads]))
    assert ours.shape == (1,) and ours.dtype == torch.float32
    assert torch.allclose(ours[0], theirs, rtol=1e-6, atol=0)


def test_the_norm_of_a_long_tensor_is_exact_to_float32():
    """A published vocabulary's embedding gradient (151936 x 64, a Qwen2-VL-2B replica's):
    torch's float32 CPU norm (``_foreach_norm``, ``vector_norm``, megatron-core's fallback's
    ``torch.norm``) adds its squares in float32 and comes out ~2e-4 low, more than the
    embedding's share of a step's norm moves between layouts that split it (TP, the
    distributed optimizer); the CPU norm is float64's, rounded once."""
    generator = torch.Generator().manual_seed(0)
    grads = [torch.rand((151936, 64), generator=generator), torch.randn(7, generator=generator)]
    ours, _ = foreach_l2_norm(2048, NOOP, [grads], False)
    exact = torch.cat([g.double().flatten() for g in grads]).norm()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours[0].double(), exact, rtol=2e-7, atol=0)


@pytest.mark.parametrize("scale", [0.37, 1.0])
def test_scaling_and_copying_are_megatron_cores_fallbacks(scale):
    sources = _grads(1)
    in_place = [g.clone() for g in sources]
    foreach_scale(2048, NOOP, [in_place, in_place], scale)
    theirs = [g.clone() for g in sources]
    utils.local_multi_tensor_scale(2048, NOOP, [theirs, theirs], scale)
    assert all(torch.equal(a, b) for a, b in zip(in_place, theirs))
    # main weights (fp32) into the model's (bf16), as the optimizer copies them each step
    ours = [torch.zeros_like(g, dtype=torch.bfloat16) for g in sources]
    foreach_scale(2048, NOOP, [sources, ours], scale)
    expected = [torch.zeros_like(g, dtype=torch.bfloat16) for g in sources]
    utils.local_multi_tensor_scale(2048, NOOP, [sources, expected], scale)
    assert all(torch.equal(a, b) for a, b in zip(ours, expected))


def test_no_value_is_read_on_the_host():
    # on the meta device a tensor has no values: reading one (a host sync on a GPU) raises
    grads = [torch.empty(shape, device="meta") for shape in [(7,), (64, 48), (3, 5)]]
    norm, _ = foreach_l2_norm(2048, NOOP, [grads], False)
    assert norm.device.type == "meta" and norm.shape == (1,)
    foreach_scale(2048, NOOP, [grads, grads], 0.5)
    with pytest.raises((RuntimeError, NotImplementedError)):   # what megatron-core does
        utils.local_multi_tensor_l2_norm(2048, NOOP, [grads], False)


def test_importing_mimo_train_mcore_puts_them_in_place():
    assert mcore.FOREACH_NORM is True           # neither TransformerEngine nor apex here
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale
    assert optimizer.multi_tensor_scale_impl is foreach_scale
    assert optimizer._multi_tensor_copy_this_to_that is foreach_copy


def test_the_norm_dispatches_as_many_operators_for_any_number_of_tensors():
    """No cast a tensor: the norms stacked once (fp32 and bf16 gradients alike)."""
    def dispatched(grads):
        with _Calls() as calls:
            foreach_l2_norm(2048, NOOP, [grads], False)
        return calls.names
    few, many = _grads(), _grads() * 20 + [torch.ones(3, dtype=torch.bfloat16)]
    assert dispatched(few) == dispatched(many), (dispatched(few), dispatched(many))


def test_the_bf16_weights_copy_is_one_multi_tensor_call():
    """megatron-core's mixed-precision optimizer in bf16 copies its fp32 main weights into the
    model's with ``_multi_tensor_copy_this_to_that`` and no overflow buffer, which loops: a
    copy per tensor. ``foreach_copy`` makes the same bf16 weights in one multi-tensor call."""
    main = _grads()
    expected = [torch.empty_like(t, dtype=torch.bfloat16) for t in main]
    assert MEGATRON_COPY.__module__ == "megatron.core.optimizer.optimizer"
    MEGATRON_COPY(this=main, that=expected, overflow_buf=None)     # its loop without a buffer
    ours = [torch.empty_like(t, dtype=torch.bfloat16) for t in main]
    with _Calls() as calls:
        optimizer._multi_tensor_copy_this_to_that(this=main, that=ours, overflow_buf=None)
    assert calls.names == ["_foreach_copy_"]
    assert all(torch.equal(a, b) for a, b in zip(ours, expected))
