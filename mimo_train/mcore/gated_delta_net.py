"""megatron-core's gated delta-net layer (Qwen3.5's linear attention) on every device, exact per
sample when sequences are packed.

megatron-core 0.19.2's ``megatron.core.ssm.gated_delta_net.GatedDeltaNet`` (tensor-parallel
heads, sharded checkpoints, one fused ``in_proj``) is built on flash-linear-attention (fla,
Triton: GPU only). Two patches of its modules (``PATCHES``, with what fails without each;
tests/test_gated_delta_net.py shows the failure and the layer's results with it), applied at
this module's import, which ``mimo_train.mcore`` makes, so every layer built through the gateway
is served:

- ``kernels``, when fla is absent, refuses to train here (``delta_rule.fla_refusal``: its
  backward pass on Hopper with torch 2.11's Triton) or CUDA is: without fla the constructor
  raises ImportError (``if not HAVE_FLA``) and the module globals its forward calls
  (``causal_conv1d`` and ``chunk_gated_delta_rule`` bound in ``gdn.py``, ``l2norm`` in
  ``common.py``) are None; with a refusing fla they are fla's, which raise in the first
  backward pass. They become ``mcore.delta_rule``'s kernels (fla's where fla serves the
  tensor, torch ones honouring ``cu_seqlens`` elsewhere). Where fla serves a GPU,
  megatron-core keeps fla's, unchanged.

On the CPU its ``@jit_fuser`` methods run as written (``cpu_compat``'s ``compiled_methods``).
A patch of module globals rather than a subclass: the constructor's fla check and the
forward's calls read those globals, so a subclass would have to copy both (about 300 lines of
megatron-core). megatron-core's ``deterministic_mode`` torch path is left alone: it runs a
packed row as one sequence and refuses packed input; mimo never sets it (the kernels here are
deterministic).

- ``contiguous_cut``: megatron-core's layer runs under context parallelism with all-to-alls
  over its heads (its own ``tensor_a2a_cp2hp`` / ``hp2cp``: each rank the whole sequence of its
  share of the heads, the convolution's and ``A_log``'s slices of them), but takes the tokens in
  Transformer Engine's load-balanced order; mimo's cut (``mcore.context_parallel``) is
  contiguous, so the reorderings are left out (they only run at cp > 1).
- ``quiet_slices``: its ``get_parameter_local_cp`` (cp > 1) indexes a parameter with a list of
  slices, which torch warns of on every rank; the same slices, without the warning.

``GatedDeltaNet`` below is megatron-core's layer with one change for mimo's packed rows: mimo's
language model hands a packed row to its layers as one sbhd sequence (``mcore.attention``:
``qkv_format`` becomes "sbhd", ``cu_seqlens`` kept), which megatron-core's layer would read as
one unpacked sequence, state leaking across samples; this one keeps the samples apart whatever
the format. ``GatedNorm`` is its gated output norm (``out_norm``), ``module_spec()`` the layer as
a local ``TransformerLayer``'s ``self_attention``, ``saved_in_sections`` a tensor of ``in_proj``'s
rows (a LoRA adapter's B) saved section by section as the layer saves ``in_proj.weight``
(megatron-core's private ``_split_tensor_factory``).

Packing stays per sample for the hybrid layers: every packed sample starts from a zero
recurrent state and a zero convolution window, exactly as if it ran alone. On a GPU with fla,
megatron-core's layer runs fla's kernels on ``cu_seqlens``; on the CPU, or a GPU without fla,
``mcore.delta_rule``'s torch kernels do the same (the recurrence restarts at each sample's first
chunk, the convolution sees zeros before each sample's first token); the gated full-attention
layers keep attention inside each sample from the same ``cu_seqlens`` (``mcore.attention``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

import megatron.core.ssm.gated_delta_net as package
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules, common, gdn
from megatron.core.ssm.utils import _split_tensor_factory
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from mimo_train.mcore.delta_rule import (causal_conv1d, chunk_gated_delta_rule, fla_usable,
                                          host_bounds, l2norm)


@dataclass(frozen=True)
class Patch:
    name: str
    failure: str              # what fails in megatron-core 0.19.2 without it, and how
    needed: Callable[[], bool]
    apply: Callable[[], None]


def _give_kernels() -> None:
    names = {"HAVE_FLA": True, "l2norm": l2norm, "causal_conv1d": causal_conv1d,
             "chunk_gated_delta_rule": chunk_gated_delta_rule}
    for module in (common, gdn, package):
        for name, value in names.items():
            if hasattr(module, name):
                setattr(module, name, value)


# megatron-core's all-to-alls, as they are before ``_contiguous_cut`` binds their arguments
_CP_TO_HEADS, _HEADS_TO_CP = common.tensor_a2a_cp2hp, common.tensor_a2a_hp2cp


def _same_order(cu_seqlens: torch.Tensor, cp_size: int, t_global: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``_build_thd_cp_a2a_perm``'s place: the tokens stay in their order (the identity)."""
    order = torch.arange(t_global, device=cu_seqlens.device)
    return order, order


def _contiguous_cut() -> None:
    gdn.tensor_a2a_cp2hp = functools.partial(_CP_TO_HEADS, undo_attention_load_balancing=False)
    common.tensor_a2a_hp2cp = functools.partial(_HEADS_TO_CP,
                                                redo_attention_load_balancing=False)
    gdn._build_thd_cp_a2a_perm = _same_order


_LOCAL_CP = gdn.get_parameter_local_cp


def _local_cp_quiet(*args, **kwargs):
    """``get_parameter_local_cp`` without torch's warning of its list of slices as an index
    (read as their tuple, as written: the same slices)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Using a non-tuple sequence for multidimensional "
                                "indexing", UserWarning)
        return _LOCAL_CP(*args, **kwargs)


def _quiet_slices() -> None:
    gdn.get_parameter_local_cp = _local_cp_quiet


PATCHES: dict[str, Patch] = {patch.name: patch for patch in (
    Patch("kernels",
          "common.py:141 _GDNBase.__init__: ImportError: FLA is not installed; past it, "
          "gdn.py:62 takes chunk_gated_delta_rule, None without fla (common.py:193 "
          "AssertionError: Attribute gated_delta_rule for GDN is not set), and the forward "
          "calls causal_conv1d (gdn.py:214) and l2norm (common.py:411), None too (TypeError: "
          "'NoneType' object is not callable); with fla but no CUDA, fla's Triton kernels get "
          "CPU tensors; with an fla that refuses its backward pass here (Hopper, Triton 3.4 "
          "to 3.7.0), its kernels raise in the first backward pass",
          lambda: not common.HAVE_FLA or not torch.cuda.is_available() or not fla_usable(),
          _give_kernels),
    Patch("contiguous_cut",
          "under context parallelism the layer takes its tokens as Transformer Engine's "
          "load-balanced cut (two chunks per rank, 2·cp per sequence): gdn.py:162 "
          "tensor_a2a_cp2hp undoes it, common.py:363 tensor_a2a_hp2cp redoes it, gdn.py:157 "
          "_build_thd_cp_a2a_perm reorders a packed row by it; mimo's cut is contiguous "
          "(mcore.context_parallel), so those steps put the tokens out of order (the "
          "convolution and the recurrence run over a shuffled sequence: a wrong loss, no error)",
          lambda: True, _contiguous_cut),
    Patch("quiet_slices",
          "under context parallelism common.py:667 get_parameter_local_cp indexes a parameter "
          "with a list of slices, which torch (2.9 on) warns of on every rank at each step's "
          "first use (UserWarning: Using a non-tuple sequence for multidimensional indexing); "
          "torch 2.11 still reads it as the tuple of slices it means",
          lambda: True, _quiet_slices),
)}


def activate(only=None, force: bool = False) -> list[str]:
    """Apply the patches (all, or the names in ``only``) that are needed here, or all of them
    with ``force``; return the names applied. Each is idempotent."""
    names = list(PATCHES) if only is None else list(only)
    unknown = sorted(set(names) - set(PATCHES))
    if unknown:
        raise ValueError(f"unknown gated_delta_net patch(es) {unknown}; known: {sorted(PATCHES)}")
    done = [name for name in names if force or PATCHES[name].needed()]
    for name in done:
        PATCHES[name].apply()
    return done


class GatedNorm:
    """The gated delta-net's output norm (``GatedDeltaNetSubmodules.out_norm``), as Qwen3.5's
    ``Qwen3_5RMSNormGated`` has it: an RMS norm over each head, ``weight · x / rms(x)``, the
    weight initialized to ones; megatron-core multiplies by ``silu(z)`` after it. Whatever
    ``config.normalization`` and ``config.layernorm_zero_centered_gamma`` say (Qwen3.5's
    decoder norms are zero-centred, ``(1 + weight)``; this one is not), so transformers'
    ``norm.weight`` maps to it unchanged. Its weight is shared by all heads, so each
    tensor-parallel rank's gradient is a partial sum over its heads: marked
    ``sequence_parallel``, megatron-core's ``finalize_model_grads`` sums it over the TP ranks
    under sequence parallelism, and only then: without it ``sum_partial_gradients`` does
    (marked ``partial_over_tensor_parallel``)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-6, **_) -> torch.nn.RMSNorm:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        norm.weight.partial_over_tensor_parallel = True
        return norm


def sum_partial_gradients(module: torch.nn.Module, tp_group) -> None:
    """Sum over the TP ranks the gradients (``main_grad``) of ``module``'s parameters that each
    rank holds whole but computes only a part of (``partial_over_tensor_parallel``: the gated
    norm's weight, shared by the heads the ranks split), where megatron-core's
    ``finalize_model_grads`` does not (it sums those marked ``sequence_parallel`` under
    sequence parallelism only). Linear in the gradients, so before or after their
    data-parallel reduction alike."""
    if tp_group.size() == 1:
        return
    for parameter in module.parameters():
        if getattr(parameter, "partial_over_tensor_parallel", False) and \
                not parameter.sequence_parallel and parameter.requires_grad:
            torch.distributed.all_reduce(parameter.main_grad, group=tp_group)


def _one_set_of_bounds(params: PackedSeqParams) -> PackedSeqParams:
    """``params`` as THD (mimo's packed rows come as sbhd: ``mcore.attention``), the key's
    boundaries the query's own tensors where they hold the same values (the host's copies
    say): megatron-core's layer compares the two with ``torch.equal``, which for one tensor
    reads nothing from the device."""
    def same(q: torch.Tensor | None, k: torch.Tensor | None) -> bool:
        return q is k or (q is not None and k is not None and host_bounds(q) == host_bounds(k))
    kv, kv_padded = params.cu_seqlens_kv, params.cu_seqlens_kv_padded
    if same(params.cu_seqlens_q, kv) and same(params.cu_seqlens_q_padded, kv_padded):
        kv, kv_padded = params.cu_seqlens_q, params.cu_seqlens_q_padded
    return dataclasses.replace(params, qkv_format="thd", cu_seqlens_kv=kv,
                               cu_seqlens_kv_padded=kv_padded)


class GatedDeltaNet(gdn.GatedDeltaNet):
    """megatron-core's ``GatedDeltaNet`` that keeps a packed row's samples apart in any
    ``qkv_format``: a packed row handed as one sbhd sequence (``mcore.attention``) goes to
    megatron-core's layer as THD with the same boundaries (``_one_set_of_bounds``)."""

    def forward(self, hidden_states, attention_mask, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        if packed_seq_params is not None:
            packed_seq_params = _one_set_of_bounds(packed_seq_params)
        return super().forward(hidden_states, attention_mask, inference_context,
                               packed_seq_params, sequence_len_offset, **kwargs)

    def _resolve_cu_seqlens(self, cu_seqlens_padded, cu_seqlens_actual, total_seq_len, name,
                            cp_size: int = 1) -> torch.Tensor:
        """megatron-core's, without its demand that cp divide every sample's length (its
        load-balanced cut's): under mimo's contiguous cut the all-to-all gives each rank the
        whole row of its heads, whatever the samples' lengths. Its check of the last boundary
        reads the host's copy (``host_bounds``: once a micro-batch, not twice a layer)."""
        cu_seqlens = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens_actual
        if host_bounds(cu_seqlens)[-1] != total_seq_len:
            raise ValueError(f"GDN: {name}[-1]={host_bounds(cu_seqlens)[-1]} does not match "
                             f"total_sequence_length={total_seq_len}")
        return cu_seqlens


# megatron-core's ``GatedDeltaNet.sharded_state_dict`` saves these weights split into sections
# (``<name>.<section>``, each resharded over TP on its own): their sections in the local layout;
# a LoRA adapter's B on ``in_proj`` (``mimo_train.model.lora``) is saved as ``in_proj.weight`` is
SAVED_SECTIONS = {"in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
                  "in_proj.lora.b.weight": ("query", "key", "value", "z", "beta", "alpha"),
                  "conv1d.weight": ("query", "key", "value"),
                  "conv1d.bias": ("query", "key", "value")}


def saved_in_sections(tensor, sizes, names):
    """The ``ShardedTensor`` ``tensor`` (rows of a TP rank: sections of ``sizes`` rows, one
    after another, named ``names``) saved section by section (``<key>.<name>``, each a global
    tensor resharded over TP on its own), as megatron-core saves ``in_proj.weight``: a
    ``ShardedTensorFactory`` from megatron-core's ``_split_tensor_factory``."""
    return _split_tensor_factory(tensor, list(sizes), list(names), 0)


def joined_sections(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (whole, as a checkpoint holds them) with each ``SAVED_SECTIONS`` weight's
    sections joined back into the one tensor the layer holds at TP 1."""
    joined = dict(tensors)
    for key in tensors:
        for name, sections in SAVED_SECTIONS.items():
            if key.endswith(f"{name}.{sections[0]}"):
                stem = key[:-len(sections[0]) - 1]
                joined[stem] = torch.cat([joined.pop(f"{stem}.{s}") for s in sections])
    return joined


def module_spec() -> ModuleSpec:
    """The gated delta-net as a local ``TransformerLayer``'s ``self_attention``: the fused input
    projection and the output projection megatron-core's local linear layers (the layer's own
    ``input_layernorm`` before it: not fused), ``GatedNorm`` between."""
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=GatedNorm, out_proj=RowParallelLinear),
        metainfo={"fuse_input_layernorm": False})


APPLIED = activate()
