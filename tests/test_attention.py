"""mimo_train/mcore/attention.py: which kernels a run picks, and the language attention backends
against the local reference on the same inputs.

- ``choose``: ``auto`` is the local reference on the CPU, varlen on CUDA in bf16 (flash-capable
  GPU), SDPA otherwise; flash-attention-2 towers only on such GPUs with the package installed,
  else mimo's varlen towers where the language model gets varlen;
  an impossible ``varlen`` is refused naming what it needs;
- the block-diagonal causal mask against one written out by hand;
- ``CoreAttention``: SDPA and varlen (its kernel replaced by a per-sample stand-in that checks
  the arguments the real one takes: the varlen kernel needs CUDA) equal the local attention,
  unpacked and packed, with grouped query heads, forward and backward.

End to end (rotary angles per token, whole training steps) the backends are compared in
tests/test_train_parity.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mimo_train.mcore.attention import (AttentionChoice, CoreAttention, Kernels, block_causal_mask,
                                  choose)
from mimo_train.errors import TrainConfigError

CPU = Kernels(cuda=False, flash_capable=False, varlen=True, flash_attn_2=False)
H100 = Kernels(cuda=True, flash_capable=True, varlen=True, flash_attn_2=True)
V100 = Kernels(cuda=True, flash_capable=False, varlen=True, flash_attn_2=False)
H200 = Kernels(cuda=True, flash_capable=True, varlen=True, flash_attn_2=False)   # the GPU check's
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("setting, dtype, kernels, language, encoders", [
    ("auto", FP32, CPU, "local", "sdpa"),
    ("auto", BF16, CPU, "local", "sdpa"),
    ("auto", BF16, H100, "varlen", "flash_attention_2"),
    ("auto", FP32, H100, "sdpa", "sdpa"),
    ("auto", BF16, V100, "sdpa", "sdpa"),
    ("auto", BF16, Kernels(True, True, False, False), "sdpa", "sdpa"),
    ("auto", BF16, H200, "varlen", "varlen"),            # no flash-attn: mimo's tower kernel
    ("varlen", BF16, H200, "varlen", "varlen"),
    ("sdpa", BF16, H200, "sdpa", "sdpa"),
    ("local", BF16, H200, "local", "sdpa"),
    ("auto", FP32, H200, "sdpa", "sdpa"),
    ("sdpa", FP32, CPU, "sdpa", "sdpa"),
    ("local", BF16, H100, "local", "flash_attention_2"),
    ("varlen", BF16, H100, "varlen", "flash_attention_2"),
])
def test_choice(setting, dtype, kernels, language, encoders):
    assert choose(setting, dtype, kernels) == AttentionChoice(language, encoders)


@pytest.mark.parametrize("dtype, kernels, needs", [
    (BF16, CPU, "needs CUDA"), (FP32, H100, "needs bf16"),
    (BF16, V100, "needs a GPU of compute capability 8.0"),
    (BF16, Kernels(True, True, False, False), "needs torch.nn.attention.varlen")])
def test_impossible_varlen_is_refused(dtype, kernels, needs):
    with pytest.raises(TrainConfigError, match=f"model.attention is varlen, which {needs}"):
        choose("varlen", dtype, kernels)


def test_block_causal_mask_by_hand():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(block_causal_mask(cu, 5), expected)


# ------------------------------------------------------------------------------- backends

HEADS, GROUPS, DIM = 4, 2, 8
BOUNDS = [0, 5, 12, 20]                   # three samples packed in one row


@pytest.fixture(scope="module")
def attention():
    """Build ``CoreAttention(backend)`` in a one-process gloo group (megatron-core needs a
    tensor-parallel group)."""
    from megatron.core.transformer.enums import AttnMaskType

    from mimo_train.runtime import distributed
    from mimo_train.mcore import (ProcessGroupCollection, TransformerConfig,
                                  model_parallel_cuda_manual_seed, parallel_state)
    distributed.init(torch.device("cpu"))
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, use_cpu_initialization=True,
                               attention_dropout=0.0)
    pgs = ProcessGroupCollection(tp=dist.new_group([0]))

    def build(backend: str) -> CoreAttention:
        return CoreAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                             attention_type="self", pg_collection=pgs, backend=backend)
    yield build
    distributed.destroy()


def _qkv(shape_q, shape_kv):
    torch.manual_seed(0)
    return [torch.randn(shape, requires_grad=True) for shape in (shape_q, shape_kv, shape_kv)]


def _packed(bounds):
    from megatron.core.packed_seq_params import PackedSeqParams
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _outputs_and_grads(function, inputs):
    out = function(*inputs)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    return out.detach(), grads


class _Operators(TorchDispatchMode):
    """The names of the ATen operators run inside it (``aten.squeeze.dim`` is ``squeeze``)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _assert_same(ours, reference):
    (out, grads), (ref_out, ref_grads) = ours, reference
    torch.testing.assert_close(out.reshape(ref_out.shape), ref_out, rtol=1e-5, atol=1e-5)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad.reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)


def test_sdpa_equals_local_unpacked(attention):
    inputs = _qkv((16, 2, HEADS, DIM), (16, 2, GROUPS, DIM))
    local, sdpa = attention("local"), attention("sdpa")
    reference = _outputs_and_grads(lambda q, k, v: local(q, k, v, None), inputs)
    _assert_same(_outputs_and_grads(lambda q, k, v: sdpa(q, k, v, None), inputs), reference)


def _reference_packed(attention, inputs):
    """The local backend on the THD layout megatron-core gives it: [tokens, heads, dim]."""
    local = attention("local")
    return _outputs_and_grads(lambda q, k, v: local(q[:, 0], k[:, 0], v[:, 0], None,
                                                    packed_seq_params=_packed(BOUNDS)), inputs)


def test_sdpa_equals_local_packed(attention):
    inputs = _qkv((BOUNDS[-1], 1, HEADS, DIM), (BOUNDS[-1], 1, GROUPS, DIM))
    sdpa = attention("sdpa")
    _assert_same(_outputs_and_grads(lambda q, k, v: sdpa(q, k, v, None,
                                                         packed_seq_params=_packed(BOUNDS)),
                                    inputs), _reference_packed(attention, inputs))


def test_varlen_equals_local_packed(attention, monkeypatch):
    """The varlen path with its kernel replaced by per-sample causal SDPA in its grouped-query
    mode (query head i reads group i // (heads / groups), as flash kernels do); the stand-in
    checks what the real kernel requires (int32 boundaries, an int longest length, causal
    window, the layer's softmax scale) and that the keys and values reach it as their groups,
    not repeated to the query heads, the values contiguous (a view would keep the whole
    fused QKV output for the backward pass), through views whose backward copies nothing."""
    import torch.nn.attention.varlen as varlen
    calls = []
    layer = attention("varlen")

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and isinstance(max_q, int)
        assert window_size == (-1, 0) and scale == layer.softmax_scale
        assert q.shape[1] == HEADS and k.shape[1] == v.shape[1] == GROUPS < HEADS
        assert v.is_contiguous() and max_q == max_k == 8
        bounds = cu_q.tolist()
        calls.append(bounds)
        return torch.cat([F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale,
            enable_gqa=True).transpose(0, 1) for a, b in zip(bounds, bounds[1:])])
    monkeypatch.setattr(varlen, "varlen_attn", stand_in)
    inputs = _qkv((BOUNDS[-1], 1, HEADS, DIM), (BOUNDS[-1], 1, GROUPS, DIM))
    # the keys and values as megatron-core gives them: views of one fused projection output
    with _Operators() as operators:
        ours = _outputs_and_grads(lambda q, k, v: layer(
            q, *torch.cat([k, v], -1).split(DIM, -1), None, packed_seq_params=_packed(BOUNDS)),
            inputs)
    assert calls == [BOUNDS]
    # the row's batch dimension squeezed away, not indexed: indexing's backward
    # (select_backward) fills a zero tensor and copies each gradient in
    assert "select_backward" not in operators.names and "squeeze" in operators.names
    _assert_same(ours, _reference_packed(attention, inputs))
