"""One training step's pieces, given to megatron-core's schedules.

- ``model_inputs``: a loader batch → ``MimoModel.forward`` kwargs on the device. The loader
  gives each rank only the keys its role needs; ``modality_inputs`` are re-keyed from the
  modality to the encoder module serving it (the same name unless the layout tags a module with
  another name), as ``MimoModel`` expects.
- ``forward_step`` / ``loss_func``: loss on the last language stage as ``(sum, tokens,
  report)`` (per-token loss); other stages return their activations dict for the schedule.
- ``GradientFinalizer``: after the backward passes, each local module's DDP reduces its
  gradients over its own DP group (summing: ``calculate_per_token_loss``), then every module is
  scaled by 1 / the *global* count of trained tokens of the step. That count exists only on the
  last language stage, so it is summed over the world and every rank, encoders included, divides
  by the same number: gradients do not depend on the layout (docs/architecture.md,
  "One sample", step 10).
- ``no_sync``: all local modules' DDP ``no_sync`` at once, for micro-batch accumulation.

Nothing here reads a device tensor on the host: the token count, the loss sums and the forward
times stay on the device (the sums reduced over the world by device collectives) until
``metrics`` reads them at a logging step, so a CUDA step queues its kernels without waiting.
"""

from __future__ import annotations

import contextlib
import math
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mimo_data.loading.layout import LANGUAGE
from mimo_data.preprocess.collate import LENGTH_MULTIPLE
from mimo_data.preprocess.preprocessor import IGNORE_INDEX
from mimo_train.families.base import HOST_INPUTS
from mimo_train.mcore.balance import GlobalBalance
from mimo_train.mcore.language_loss import HostLabels
from mimo_train.mcore.grids import Infra
from mimo_train.mcore import finalize_model_grads
from mimo_train.mcore.gated_delta_net import sum_partial_gradients
from mimo_train.components.metrics import Timer
from mimo_train.runtime.profile import mark_phase


def model_inputs(batch: dict, infra: Infra, device: torch.device,
                 shared: dict[str, dict[str, int]] | None = None) -> dict:
    """Loader batch → ``MimoModel`` kwargs for this rank, tensors on ``device``.

    The loader pads every sample to ``seq_length``; columns past the batch's longest sample
    (rounded up to ``LENGTH_MULTIPLE``) are dropped first. They hold only padding, which is
    never trained and, on the right under a causal mask, never attended to by real tokens, so
    loss and gradients are unchanged while the language model skips most of the padding.
    A packed batch (``packing_kwargs``) has no padding: it goes as it is, and ``MimoModel``
    makes megatron-core's ``PackedSeqParams`` of its sample boundaries. Under context
    parallelism either is padded to a multiple of cp x tp (``shard_multiple``). Encoder
    inputs that an encoder reads on the host (``families.base.HOST_INPUTS``) stay there, and
    the token ids go on the host too (``host_input_ids``: ``mcore.splice`` counts the
    placeholders there).

    ``shared``: per encoder module serving several modalities (``model.shared_placeholders``),
    ``{modality: its placeholder token id}``, its encoder's own modality first. That module
    gets ``{first modality: {modality: inputs, ..., "placeholders": modality index of each
    placeholder in token order (on the host)}}``, and its other modalities' placeholders
    become the first one's in ``input_ids``: megatron-core splices one token id per module.
    """
    shared = shared or {}
    ids = batch.get("input_ids")
    placeholders = {}
    for module, tokens in shared.items():
        if ids is not None:
            placeholders[module], ids = _shared_placeholders(ids, list(tokens.values()))
    if ids is not None:
        batch = {**batch, "input_ids": ids}
    packing = batch.get("packing_kwargs")
    multiple = shard_multiple(infra)
    length = kept_length(batch, multiple)
    columns = {key: value[..., :length] for key, value in batch.items()
               if isinstance(value, torch.Tensor) and key != "attention_mask"}
    if multiple > 1:
        columns, packing = _padded(columns, packing, multiple)
    inputs = {key: to_device(value, device)       # the [(3,) B, length] tensors
              for key, value in columns.items()}
    inputs["host_input_ids"] = columns.get("input_ids")        # the placeholders' counts
    # Padding is on the right and never trained, so the causal mask alone is right for every
    # real token; megatron-core's non-colocated path would read a dense mask as True = masked.
    inputs["attention_mask"] = None
    inputs.setdefault("input_ids", None)         # later pipeline stages get no token ids
    if packing is not None:
        inputs["packing_kwargs"] = {key: to_device(value, device)
                                    if isinstance(value, torch.Tensor) else value
                                    for key, value in packing.items()}
    modules = infra.layout.modalities
    module_inputs: dict = {}
    for modality, by_encoder in (batch.get("modality_inputs") or {}).items():
        module = modules[modality]
        on_device = {encoder: {k: v if k in HOST_INPUTS else to_device(v, device)
                               for k, v in kw.items()} for encoder, kw in by_encoder.items()}
        if module in shared:
            first = next(iter(shared[module]))
            merged = module_inputs.setdefault(module, {first: {        # read on the host
                "placeholders": placeholders[module]}})
            merged[first].update(on_device)
        else:
            module_inputs[module] = on_device
    inputs["modality_inputs"] = module_inputs or None
    return inputs


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, queued behind the device's work: only a copy to a GPU from
    contiguous page-locked memory is (from pageable memory, or through the pageable copy torch
    makes of a strided view, the host may wait for the device). The loader pins its batches;
    what is cut or padded from them here is made contiguous and pinned first."""
    if device.type == "cuda" and not (tensor.is_pinned() and tensor.is_contiguous()):
        tensor = tensor.contiguous().pin_memory()
    return tensor.to(device, non_blocking=True)


def kept_length(batch: dict, multiple: int = 1) -> int | None:
    """The columns ``model_inputs`` keeps of a padded batch: its longest sample's, rounded up
    to ``LENGTH_MULTIPLE`` and ``multiple`` (None: all, a packed batch)."""
    real = batch.get("attention_mask")
    if real is None or batch.get("packing_kwargs") is not None:
        return None
    longest = int(real.sum(1).max())
    step = math.lcm(LENGTH_MULTIPLE, multiple)
    return min(real.size(1), -(-longest // step) * step)


def real_tokens(batch: dict, multiple: int = 1) -> torch.Tensor | None:
    """The real-token mask ``[B, length]`` of the columns ``model_inputs`` gives the model
    (None: every column is a real token, a packed row without padding, or the batch has no
    mask)."""
    if batch.get("attention_mask") is None:
        return None
    mask = batch["attention_mask"][:, :kept_length(batch, multiple)]
    pad = -mask.size(1) % multiple
    if not pad and batch.get("packing_kwargs") is not None:
        return None
    return F.pad(mask, (0, pad), value=False)


def host_labels(batch: dict, multiple: int = 1) -> torch.Tensor:
    """The labels ``[B, length]`` of the columns ``model_inputs`` gives the model, on the host
    (the loss's count of trained tokens, ``mcore.language_loss.HostLabels``)."""
    labels = batch["labels"][:, :kept_length(batch, multiple)]
    return F.pad(labels, (0, -labels.size(1) % multiple), value=IGNORE_INDEX)


def shard_multiple(infra: Infra) -> int:
    """What the language model's sequence must be a multiple of: cp x tp under context
    parallelism (each CP rank a contiguous part, sequence parallelism's TP parts of it), else 1
    (no padding added)."""
    language = infra.layout.language
    return language.cp * language.tp if language.cp > 1 else 1


def _padded(columns: dict, packing: dict | None, multiple: int) -> tuple[dict, dict | None]:
    """``columns`` (``[(3,) B, length]``) padded on the right to a multiple of ``multiple``:
    token 0, untrained (``IGNORE_INDEX``, loss mask 0), position 0. A packed row's padding joins
    its last sample (after it: no real token attends to it), which its ``cu_seqlens`` and
    ``max_seqlen`` say."""
    length = next(iter(columns.values())).size(-1)
    pad = -length % multiple
    if not pad:
        return columns, packing
    columns = {key: F.pad(value, (0, pad), value=IGNORE_INDEX if key == "labels" else 0)
               for key, value in columns.items()}
    if packing is not None:
        bounds = packing["cu_seqlens_q"].clone()
        bounds[-1] += pad
        last = int(bounds[-1] - bounds[-2])
        packing = {**packing, "cu_seqlens_q": bounds, "cu_seqlens_kv": bounds.clone(),
                   "max_seqlen_q": max(packing["max_seqlen_q"], last),
                   "max_seqlen_kv": max(packing["max_seqlen_kv"], last)}
    return columns, packing


def _shared_placeholders(ids: torch.Tensor, tokens: list[int]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The index in ``tokens`` of each of ``ids``' placeholders of any of them, in token
    order (rows one after another), and ``ids`` with all of them written as ``tokens[0]``."""
    table = torch.tensor(tokens)
    hits = torch.isin(ids, table)
    found = ids[hits]
    kinds = (found[:, None] == table).int().argmax(1)
    return kinds, torch.where(hits, tokens[0], ids)


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Per-token loss: ``(sum over trained tokens, their count, report [sum, count])``."""
    mask = loss_mask.reshape(-1).float()
    total = (output.float().reshape(-1) * mask).sum()
    tokens = mask.sum().to(torch.int)
    return total, tokens, {"lm loss": torch.stack([total.detach(), mask.sum().detach()])}


class ForwardStep:
    """``forward_step_func`` for the schedules; also times this rank's forward passes
    (``timers``: one ``Timer`` per micro-batch since the trainer last emptied the list) and
    its waits for them (``waits``: the host seconds each ``next(data_iterator)`` took, the
    same micro-batches; the host's clock, no device sync) and, on the last language stage,
    hands each micro-batch's host labels to the loss (``labels``: the language model's
    ``HostLabels``)."""

    def __init__(self, infra: Infra, device: torch.device,
                 shared: dict[str, dict[str, int]] | None = None,
                 balance: GlobalBalance | None = None, labels: HostLabels | None = None):
        self.infra = infra
        self.device = device
        self.shared = shared
        self.balance = balance
        self.labels = labels
        self.last_stage = _language_last_stage(infra)
        self.timers: list[Timer] = []
        self.waits: list[float] = []

    def __call__(self, data_iterator, model):
        batch = None
        with mark_phase("data"):
            if data_iterator is not None:
                started = time.perf_counter()
                batch = next(data_iterator)
                self.waits.append(time.perf_counter() - started)
            inputs = model_inputs(batch, self.infra, self.device, self.shared) \
                if batch is not None else \
                {"input_ids": None}
            if self.balance is not None:          # the routers' real rows, on the device
                real = None if batch is None else real_tokens(batch, shard_multiple(self.infra))
                self.balance.tokens = None if real is None else to_device(real, self.device)
            if self.labels is not None and self.last_stage and batch is not None:
                self.labels.labels = host_labels(batch, shard_multiple(self.infra))
        timer = Timer(self.device)
        with mark_phase("forward"):
            output, loss_mask = model(**inputs)
        self.timers.append(timer.stop())
        if self.last_stage:
            return output, partial(loss_func, loss_mask)
        return output, None


def _language_last_stage(infra: Infra) -> bool:
    return any(p.name == LANGUAGE and p.last_stage for p in infra.role.modules)


def _token_counter(infra: Infra) -> bool:
    """Whether this rank's trained-token count enters the global count: language last stage,
    one rank per tensor-parallel group (TP ranks see the same tokens; CP ranks see parts)."""
    return any(p.name == LANGUAGE and p.last_stage and p.tp_rank == 0 for p in infra.role.modules)


def global_sum(values: torch.Tensor, infra: Infra, device: torch.device) -> torch.Tensor:
    """Sum over the world of ``values`` (1-D, the same length on every rank), counted only
    where language last-stage ranks hold them (TP rank 0): a float64 tensor on ``device``,
    reduced by a device collective, not read on the host."""
    tensor = values.to(device=device, dtype=torch.float64)
    if not _token_counter(infra):
        tensor = torch.zeros_like(tensor)
    dist.all_reduce(tensor)
    return tensor


class GradientFinalizer:
    """``finalize_model_grads_func``: per-module DP reduction, then 1 / global tokens."""

    def __init__(self, infra: Infra, modules: dict, device: torch.device):
        self.infra = infra
        self.modules = modules          # name -> DDP module on this rank
        self.device = device

    def __call__(self, model_list, num_tokens, pg_collection=None, force_all_reduce=False):
        local = num_tokens.reshape(1) if num_tokens is not None else torch.zeros(1)
        (tokens,) = global_sum(local, self.infra, self.device)
        scale = 1.0 / tokens.clamp(min=1.0).float()      # a device scalar: no host read
        for name, module in self.modules.items():
            pgs = self.infra.modules[name].pgs
            finalize_model_grads([module], num_tokens=None, pg_collection=pgs)
            sum_partial_gradients(module, pgs.tp)
            module.scale_gradients(scale)


@contextlib.contextmanager
def no_sync(modules: dict):
    """Every local module's DDP ``no_sync()`` (gradient accumulation over micro-batches)."""
    with contextlib.ExitStack() as stack:
        for module in modules.values():
            stack.enter_context(module.no_sync())
        yield
