"""Run megatron-core 0.19.2 on CPU with gloo: the one place that knows about it.

megatron-core assumes CUDA in a handful of places (docs/architecture.md, "Where CPU
compatibility lives").
``activate()`` patches exactly those, and only when CUDA is absent
(``torch.cuda.is_available()`` is False); with a GPU it does nothing, so NCCL runs use
megatron-core unchanged. ``mimo_train.mcore`` calls ``activate()`` at its import, before it
imports megatron-core's names (taking a function by name before the patch would keep the
unpatched one), and is the only module of mimo_train that uses this one.

Each patch is one entry of ``PATCHES``: a name, what fails without it (file:line in
megatron-core 0.19.2 and the exception) and the function that applies it. Patches are
idempotent and can be applied one by one (``activate(only=[...])``), which is how
``tests/test_train_cpu_compat.py`` shows each failure and its fix separately.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Patch:
    name: str
    failure: str          # where megatron-core fails on CPU, and how
    apply: Callable[[], None]


_applied: set[str] = set()


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or \
        (isinstance(device, torch.device) and device.type == "cuda")


class _CudaToCpu(TorchFunctionMode):
    """Inside this mode, tensors asked for on "cuda" are made on the CPU and ``Tensor.cuda()``
    is the identity; with ``type_strings``, ``Tensor.type()`` names the CUDA type the caller
    checks for. Used only around the megatron-core functions that hard-code "cuda"."""

    def __init__(self, type_strings: bool = True):
        super().__init__()
        self.type_strings = type_strings

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if self.type_strings and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor', the type checks' expectation
            # (once: an enclosing mode may have rewritten it already)
            name = func(*args)
            return name if name.startswith("torch.cuda.") else \
                name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = CPU
        if func is torch.Tensor.to and args[1:2] and _is_cuda(args[1]):
            args = (args[0], CPU, *args[2:])
        return func(*args, **kwargs)


def _scoped(owner, name: str, type_strings: bool = True) -> None:
    """Run ``owner.name`` (a function or method) under ``_CudaToCpu``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with _CudaToCpu(type_strings):
            return original(*args, **kwargs)

    setattr(owner, name, wrapper)


class _NullStream:
    """A stream on a device that runs everything in order: waiting is a no-op, and an event
    it records (the MoE all-to-all dispatcher's, before it reads the token counts on the host)
    is this stream itself, already complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record_event(self, event=None) -> _NullStream:
        return self

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _patch_streams() -> None:
    # DDP's grad sync takes torch.cuda.current_stream() (param_and_grad_buffer.py:632) to wait
    # on CUDA-graph events; CPU work is synchronous, so a stream that never waits is exact.
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.Stream = _NullStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None


def _patch_schedules() -> None:
    # Every schedule starts with total_num_tokens = torch.zeros(..., device="cuda")
    # (schedules.py:749, :1121, :2292). The schedule functions run under _CudaToCpu without
    # the type-string rewrite (the model's forward and backward run inside them).
    from megatron.core.pipeline_parallel import schedules

    for name in ("forward_backward_no_pipelining",
                 "forward_backward_pipelining_with_interleaving",
                 "forward_backward_pipelining_without_interleaving"):
        _scoped(schedules, name, type_strings=False)


def _patch_rng_tracker() -> None:
    # CudaRNGStatesTracker.add() stores CUDA generator states (random.py:104-133,
    # torch.cuda.default_generators). The inference tracker keeps no state and forks on the
    # default generator, which on CPU is torch's CPU generator: every tracked stream
    # (data-parallel, model-parallel, expert) then draws from it.
    from megatron.core.tensor_parallel import random

    original = random.initialize_rng_tracker

    @functools.wraps(original)
    def initialize_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False,
                               use_cudagraphable_rng=False, force_reset=False):
        return original(use_te_rng_tracker, True, use_cudagraphable_rng, force_reset)

    random.initialize_rng_tracker = initialize_rng_tracker


def _scoped_method(cls, name: str, value) -> None:
    """``_scoped`` for a method as the class defines it: plain, static or class method."""
    if inspect.isfunction(value):
        _scoped(cls, name)
    elif isinstance(value, (staticmethod, classmethod)):
        function = value.__func__

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with _CudaToCpu():
                return function(*args, **kwargs)

        setattr(cls, name, type(value)(wrapper))


def _patch_optimizers() -> None:
    # Loss-scale / found-inf / norm tensors are made with device='cuda', gradients are checked
    # with Tensor.type() == 'torch.cuda.FloatTensor' (optimizer.py, distrib_optimizer.py,
    # clip_grads.py, which only the optimizers call): every method the optimizer classes
    # define, the distributed optimizer's static and class methods included, runs under
    # _CudaToCpu.
    from megatron.core.models.mimo.optimizer import MimoOptimizer
    from megatron.core.optimizer import distrib_optimizer, optimizer

    classes = {cls for module in (optimizer, distrib_optimizer) for cls in vars(module).values()
               if isinstance(cls, type) and issubclass(cls, optimizer.MegatronOptimizer)}
    for cls in [*classes, MimoOptimizer]:
        for name, value in list(vars(cls).items()):
            _scoped_method(cls, name, value)


def _patch_tied_embeddings() -> None:
    # With tied embeddings over pipeline stages, the last stage's copy of the word embeddings
    # is moved with weight.data.cuda() before the all-reduce that fills it
    # (language_module.py:291); on the CPU it stays where it is.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _scoped(LanguageModule, "setup_embeddings_and_output_layer", type_strings=False)


def _patch_current_device() -> None:
    # ``torch.cuda.current_device()`` initializes CUDA and raises "Found no NVIDIA driver"
    # without a GPU. megatron-core only uses its result as a ``device=`` argument, so the
    # CPU device is the faithful replacement.
    torch.cuda.current_device = lambda: CPU


def _patch_nccl_groups() -> None:
    # The bridge communicator asks for NCCL groups explicitly; NCCL needs CUDA.
    def _to_gloo(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if kwargs.get("backend") == "nccl":
                kwargs["backend"] = "gloo"
            return function(*args, **kwargs)
        return wrapper

    dist.new_group = _to_gloo(dist.new_group)
    dist.new_subgroups_by_enumeration = _to_gloo(dist.new_subgroups_by_enumeration)


def _patch_recompute_rng() -> None:
    # Activation recomputation (tensor_parallel.checkpoint, CheckpointFunction) saves and
    # restores the CUDA generator's state around the recomputed forward
    # (random.py:528 _get_all_rng_states -> _get_cuda_rng_state, :538 _set_cuda_rng_state).
    # On the CPU there is no CUDA generator: the CPU generator's state, which the same
    # function saves and restores beside it, is all the recomputation draws from.
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: None
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: None


def _patch_causal_masks() -> None:
    # transformer/utils.py builds the softmax masks with a literal device="cuda";
    # fused_softmax.py imported the functions by name, so both bindings are replaced.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device=CPU), diagonal=1).bool()

    def get_sliding_window_causal_mask(sq, skv, window_size):
        mask = torch.ones(sq, skv, dtype=torch.bool, device=CPU)
        upper = torch.triu(mask, diagonal=skv - sq - window_size[0])
        return ~torch.tril(upper, diagonal=skv - sq + window_size[1])

    for module in (utils, fused_softmax):
        module.get_default_causal_mask = get_default_causal_mask
        module.get_sliding_window_causal_mask = get_sliding_window_causal_mask


# megatron-core's @jit_fuser (torch.compile) functions of the layers mimo builds: module, class
# (None: the module's own functions), names
COMPILED = (("megatron.core.transformer.attention", "Attention", ("_apply_output_gate",)),
            ("megatron.core.ssm.gated_delta_net.common", "_GDNBase",
             ("_apply_gated_norm", "_prepare_input_for_gated_delta_rule", "_compute_g_and_beta")),
            # the router's expert-bias update (traced by dynamo on every rank with experts,
            # also where the bias is off and the method does nothing)
            ("megatron.core.transformer.moe.router", "TopKRouter", ("_apply_expert_bias",)),
            # the fused SwiGLU's forward and backward (bias_activation_fusion)
            ("megatron.core.fusions.fused_bias_swiglu", None,
             ("swiglu", "bias_swiglu", "weighted_swiglu", "swiglu_back", "bias_swiglu_back",
              "weighted_swiglu_back")))


def _patch_moe_splits() -> None:
    # the all-to-all token dispatcher moves its split sizes to the host as numpy arrays only
    # when they are CUDA tensors (moe_utils.maybe_move_tensor_to_cpu); on the CPU they stay
    # tensors, which all_to_all_single's split sizes (a sequence of ints) do not take
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        moved = original(tensor, as_numpy, record_stream)
        return moved.numpy() if as_numpy and torch.is_tensor(moved) else moved

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_uneven_gathers() -> None:
    # gloo's all_gather takes parts of equal sizes only; the expert tensor-parallel ranks
    # exchange different token counts (mappings.py's split-size path): the same rows through
    # an all_gather of parts padded to the largest (gloo only: NCCL takes uneven parts)
    from megatron.core.tensor_parallel import mappings

    gather = mappings._gather_along_first_dim

    @functools.wraps(gather)
    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or dist.get_backend(group) != "gloo":
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(size) for size in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    mappings._gather_along_first_dim = gather_along_first_dim


def _patch_compiled_methods() -> None:
    # on the CPU, inductor compiles C++ for each of these methods and each new shape (over a
    # minute for one small layer on 2 cores, a C++ compiler needed); as written they compute
    # the same
    import importlib
    for module, owner, names in COMPILED:
        space = importlib.import_module(module)
        cls = space if owner is None else getattr(space, owner)
        for name in names:
            setattr(cls, name, inspect.unwrap(vars(cls)[name]))


PATCHES: dict[str, Patch] = {patch.name: patch for patch in (
    Patch("current_device",
          "torch.cuda.current_device() for allocations, e.g. rotary_pos_embedding.py:162 "
          "(RuntimeError: Found no NVIDIA driver on your system)",
          _patch_current_device),
    Patch("nccl_groups",
          "backend='nccl' groups in pipeline_parallel/bridge_communicator.py:199,209 "
          "(RuntimeError: ProcessGroupNCCL is only supported with GPUs)",
          _patch_nccl_groups),
    Patch("causal_masks",
          "device=\"cuda\" in transformer/utils.py:39 get_default_causal_mask and :44 "
          "get_sliding_window_causal_mask, used by fused_softmax.py:327 (RuntimeError: Found no "
          "NVIDIA driver)",
          _patch_causal_masks),
    Patch("streams",
          "torch.cuda.current_stream() in distributed/param_and_grad_buffer.py:632 "
          "start_grad_sync (DDP finish_grad_sync), torch.cuda.Stream in "
          "distributed_data_parallel.py:297, torch.cuda.synchronize() in "
          "p2p_communication.py:263,419 (RuntimeError: Found no NVIDIA driver)",
          _patch_streams),
    Patch("rng_tracker",
          "model_parallel_cuda_manual_seed() -> CudaRNGStatesTracker.add() reads CUDA "
          "generator states, tensor_parallel/random.py:104-133 (RuntimeError: Found no NVIDIA "
          "driver); without a seeded tracker DotProductAttention.forward fails at "
          "get_cuda_rng_tracker().fork() ('cuda rng state model-parallel-rng is not added')",
          _patch_rng_tracker),
    Patch("recompute_rng",
          "torch.cuda.random.get_rng_state() in tensor_parallel/random.py:118 "
          "_get_cuda_rng_state, from CheckpointFunction.forward (:604, activation "
          "recomputation: model.language.recompute) (RuntimeError: Found no NVIDIA driver / "
          "Cannot re-initialize CUDA in forked subprocess)",
          _patch_recompute_rng),
    Patch("schedules",
          "device=\"cuda\" for the token count in pipeline_parallel/schedules.py:749, :1121, "
          ":2292 (every forward_backward_* function; RuntimeError: Found no NVIDIA driver)",
          _patch_schedules),
    Patch("tied_embeddings",
          "weight.data.cuda() in models/common/language_module/language_module.py:291 "
          "setup_embeddings_and_output_layer, tied embeddings under pipeline stages "
          "(RuntimeError: Found no NVIDIA driver)",
          _patch_tied_embeddings),
    Patch("compiled_methods",
          "@jit_fuser (torch.compile) methods: transformer/attention.py:1623 "
          "Attention._apply_output_gate (gated attention), ssm/gated_delta_net/common.py:370, "
          ":382, :433, fusions/fused_bias_swiglu.py:15-90 (the fused SwiGLU's forward and "
          "backward), transformer/moe/router.py:727 TopKRouter._apply_expert_bias: the first "
          "forward compiles each with inductor's C++ backend (over 90 s "
          "for one small layer on 2 cores, again for each new shape; fails without a C++ "
          "compiler)",
          _patch_compiled_methods),
    Patch("moe_splits",
          "token_dispatcher.py:930-937 MoEAlltoAllTokenDispatcher keeps its input/output "
          "splits as tensors on the CPU (moe_utils.py:1184 converts CUDA ones only), then "
          "mappings.py:460 all_to_all_single under expert parallelism (TypeError: "
          "alltoall_base(): incompatible function arguments)",
          _patch_moe_splits),
    Patch("uneven_gathers",
          "tensor_parallel/mappings.py:154 all_gather of parts of different sizes, the MoE "
          "token dispatcher's over the expert tensor-parallel group (token_dispatcher.py:739; "
          "RuntimeError: ProcessGroupGloo::allgather: invalid tensor size)",
          _patch_uneven_gathers),
    Patch("optimizers",
          "device='cuda' in optimizer/optimizer.py:1249 FP32Optimizer.__init__ (loss scale), "
          ":315, :690-702, models/mimo/optimizer.py:65,82,103 MimoOptimizer.get_grad_norm/step, "
          "clip_grads.py:96-231 (RuntimeError: Found no NVIDIA driver); Tensor.type() == "
          "'torch.cuda.FloatTensor' in clip_grads.py:174 and optimizer.py:1009-1028 "
          "(AssertionError / TypeError), and in distrib_optimizer.py:401-481 "
          "_build_model_and_main_param_groups (TypeError: Wrapped parameters must be one of "
          "torch.cuda.FloatTensor, ...), device=torch.cuda.current_device() at :998",
          _patch_optimizers),
)}


def needed() -> bool:
    """True when CUDA is absent, i.e. when the patches must be applied."""
    return not torch.cuda.is_available()


def activate(only=None, force: bool = False) -> list[str]:
    """Apply the patches (all, or the names in ``only``) when CUDA is absent; return the names
    applied by this call. ``force`` applies them even with CUDA (tests only)."""
    if not (force or needed()):
        return []
    names = list(PATCHES) if only is None else list(only)
    unknown = sorted(set(names) - set(PATCHES))
    if unknown:
        raise ValueError(f"unknown cpu_compat patch(es) {unknown}; known: {sorted(PATCHES)}")
    done = []
    for name in names:
        if name not in _applied:
            PATCHES[name].apply()
            _applied.add(name)
            done.append(name)
    return done
