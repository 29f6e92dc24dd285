"""Step and evaluation records, their stdout lines (rank 0) and TensorBoard scalars.

A train record: ``step, loss, tokens, grad_norm, lr, lrs, skipped, seconds, tokens_per_s,
sequence_tokens, sequence_tokens_per_s, samples_per_s, forward_s, data_wait_s, memory_mib,
memory_mibs`` (and ``moe_aux_loss``, the global batch's load-balancing loss without its
coefficient, when on).
``tokens`` are the step's *trained* tokens (the loss's targets, its denominator; the step line's
``trained tokens`` and ``trained tok/s``); ``sequence_tokens`` every token of the step's samples
(text and media placeholders, no padding: what other frameworks' tokens/s count; the step line's
``seq tok/s``) (``lrs``: each trained module's learning rate, ``lr`` the
language model's, else the first trained module's; forward seconds per module, max over its
ranks; ``data_wait_s``: the host seconds the step's ``next()`` calls for its micro-batches
took (large: the loader does not keep up; the step line's ``data wait``; megatron-LM's
``batch-generator`` timer without its copy to the device) summed over them, max over the
ranks: part of the step's ``seconds``, on the host's clock without a device sync, so a wait
while the device still runs queued work costs it nothing, one with the device's queue empty
is the device idle; ``memory_mib``: ``PeakMemory``, max over the ranks; ``memory_mibs``: the
same per module, max over its ranks, as ``forward_s``); an evaluation record: ``step,
eval_loss, eval_tokens, eval_samples``. Every rank builds the same records (the values are
reduced over the world); only rank 0 prints and writes TensorBoard (and W&B): every step's
scalars, the line of each logging step, which with ``train.log_interval`` > 1 adds the loss
per trained token over the interval's steps (its own loss is one step's).

Reading a device value on the host waits for every kernel queued before it, so a train step
hands over ``StepValues`` whose device values are copied to the host as the device makes them
(``Readings``: the world's loss sum and token count, its FLOPs, the optimizer's outcome; one
copy into page-locked memory queued behind the step, with an event) and whose times are
``Timer``s (CUDA events on a GPU): reading them waits for that step, not for the work queued
after it. The trainer settles a step (reads its optimizer's outcome, steps the learning rates,
fills in ``grad_norm``, ``skipped`` and ``lrs``) while the next one is queued, then hands it to
``Metrics.log``, which reads the pending steps at a logging step (``train.log_interval``, the
last step, before an evaluation and at the end), all at once; their timings and learning rates
are reduced over the control group (host memory), so a record exists for every step and no
step waits for the device.

FLOPs (``FlopsCounter``, ``planning.flops``): a train record's ``flops`` are the step's model
FLOPs per layout module (the whole global batch: forward and backward, from each sample's real
tokens and each media item's grid; recomputation not counted), ``tflops_per_gpu`` their sum
per second and per rank of the world, ``mfu`` that over the peak (``train.peak_tflops`` or the
GPU's; null without one).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo_data.files import file_in_the_way, write_atomic
from mimo_data.process_memory import status_bytes
from mimo_data.modalities.base import to_device
from mimo_train.errors import TrainConfigError
from mimo_train.planning.dims import ModelDims
from mimo_train.planning.flops import step_flops
from mimo_train.runtime import distributed
from mimo_train.runtime.console import PREFIX


class Timer:
    """Time of the work queued on ``device`` from construction to ``stop()``: CUDA events on a
    GPU (read without waiting only once the work is done: ``seconds`` waits for it), the
    wall clock on the CPU, whose work is done when the call returns."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start, self.end = time.perf_counter(), math.nan

    def stop(self) -> Timer:
        if self.events is not None:
            self.events[1].record()
        self.end = time.perf_counter()
        return self

    def seconds(self) -> float:
        if self.events is None:
            return self.end - self.start
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1000


class PeakMemory:
    """A rank's peak memory growth since construction (the trainer makes it before the model is
    built), in MiB: what ``mimo_train.planning.memory`` predicts (weights, gradients, optimizer
    state, activations). On a GPU the allocator's peak (``max_memory_allocated``) over what was
    allocated at the start; on the CPU the peak resident set (``VmHWM``, its high-water mark
    reset at the start through ``/proc/self/clear_refs``) over the resident set at the start;
    elsewhere the process's ``ru_maxrss`` over the start's."""

    def __init__(self, device: torch.device):
        self.device = device if device.type == "cuda" else None
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.base = self._resident()[0]

    @staticmethod
    def _resident() -> tuple[int, int]:
        """(resident, peak resident) bytes of this process."""
        try:
            held = status_bytes("VmRSS", "VmHWM")
            return held["VmRSS"], held["VmHWM"]
        except (OSError, KeyError, ValueError):
            import resource
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            return peak, peak

    def mib(self) -> float:
        peak = torch.cuda.max_memory_allocated(self.device) if self.device is not None \
            else self._resident()[1]
        return max(0, peak - self.base) / 2**20


class Readings:
    """Named 1-D device tensors copied to the host behind the work that makes them: on a GPU
    one copy into page-locked memory and an event, so ``read`` waits for that work only, not
    for what was queued after it (a plain read waits for the whole queue); on the CPU the
    values themselves (its work is done when the call returns)."""

    def __init__(self, parts: dict[str, torch.Tensor]):
        self.sizes = {name: part.numel() for name, part in parts.items()}
        values = torch.cat([part.reshape(-1).double() for part in parts.values()])
        self.event = None
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            values = host
        self.values = values
        self.read_values: dict[str, list[float]] | None = None

    def ready(self) -> bool:
        """Whether ``read`` would not wait (the device has made the values)."""
        return self.event is None or self.event.query()

    def read(self) -> dict[str, list[float]]:
        """name -> its values (waits for the device to have made them, once)."""
        if self.read_values is None:
            if self.event is not None:
                self.event.synchronize()
            flat, self.read_values = self.values.tolist(), {}
            for name, size in self.sizes.items():
                self.read_values[name], flat = flat[:size], flat[size:]
        return self.read_values


@dataclass
class StepValues:
    """One train step as the trainer hands it over, device values not yet read."""
    step: int
    # the world's "sums" [loss sum, trained tokens], the optimizer's "outcome" [non-finite
    # flag, gradient norm], "flops": its model FLOPs per layout module, then its sequence
    # tokens; on the language ranks with model.language.moe_aux_loss, "balance": the global
    # batch's load-balancing loss
    readings: Readings
    timer: Timer                    # the whole step
    forward: list[Timer]            # this rank's forward passes
    global_batch_size: int
    # this rank's host seconds waiting for its micro-batches (``ForwardStep.waits``, summed)
    data_wait: float = 0.0
    # this rank's peak memory (``PeakMemory.mib``) once the step's work is queued: read then,
    # not when the step is settled, by when the next step's passes are queued too
    memory_mib: float = 0.0
    # set when the trainer settles the step (its optimizer's outcome read, its learning rates
    # stepped): None before; this rank's trained modules' rates after the step
    lrs: dict[str, float] | None = None
    grad_norm: float | None = None
    skipped: bool = False


def per_module(layout, values: list[float]) -> dict:
    """A value per module, its forward seconds or its peak memory (``values``: the world's
    maximum per layout module); one entry ``a+b+...`` for colocated layouts, where every rank
    runs every module."""
    names = [m.name for m in layout.modules]
    if layout.colocated:
        return {"+".join(names): max(values)}
    return dict(zip(names, values))


def train_record(step: int, loss_sum: float, tokens: float, grad_norm, lrs: dict[str, float],
                 skipped: bool, seconds: float, global_batch_size: int, forward_s: dict,
                 memory_mib: dict | None = None, data_wait_s: float | None = None) -> dict:
    """``tokens``: the trained tokens (the samples' tokens are added with the FLOPs);
    ``memory_mib``: per module (``per_module``)."""
    lr = lrs.get("language", next(iter(lrs.values()), 0.0))
    return {"step": step, "loss": loss_sum / max(tokens, 1), "tokens": int(tokens),
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "lr": float(lr), "lrs": lrs, "skipped": skipped, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "samples_per_s": global_batch_size / seconds,
            "forward_s": forward_s,
            **({"data_wait_s": data_wait_s} if data_wait_s is not None else {}),
            **({"memory_mib": max(memory_mib.values()), "memory_mibs": memory_mib}
               if memory_mib is not None else {})}


class FlopsCounter:
    """The model FLOPs of the micro-batches given to ``add`` (the loader's metadata: each
    sample's tokens, each media item's token count and grid), per layout module, until
    ``take``. Only ranks whose micro-batches together hold the global batch once count
    (``counts``: language last stage, TP and CP rank 0, one per language DP rank, as
    ``step.global_sum`` counts tokens), so the world sum the step makes of its loss gives the
    step's figure with no collective of its own. ``peak_tflops``: the MFU's denominator."""

    def __init__(self, dims: ModelDims, names: list[str], passes: dict[str, int], counts: bool,
                 peak_tflops: float | None):
        self.dims, self.names, self.passes, self.counts = dims, names, passes, counts
        self.peak_tflops = peak_tflops
        self.pending = dict.fromkeys(names, 0)
        self.sequence_tokens = 0        # every token of the samples added

    def add(self, metadata: dict) -> None:
        if not self.counts:
            return
        self.sequence_tokens += sum(metadata["tokens"])
        found = step_flops(self.dims, metadata["tokens"], metadata.get("token_counts", {}),
                           metadata.get("token_grids", {}), self.passes,
                           metadata["trained_tokens"])
        for name, value in found.items():
            self.pending[name] += value

    def take(self, device: torch.device, tokens: bool = False) -> torch.Tensor:
        """The FLOPs added since the last ``take``, per module of ``names`` (``tokens``: then
        the samples' tokens): float64 on ``device`` (copied without waiting for the device's
        queued work)."""
        values = [float(self.pending[n]) for n in self.names]
        if tokens:
            values.append(float(self.sequence_tokens))
        self.pending, self.sequence_tokens = dict.fromkeys(self.names, 0), 0
        return to_device(torch.tensor(values, dtype=torch.float64), device)


def flops_fields(flops: dict[str, float], seconds: float, world_size: int,
                 peak_tflops: float | None) -> dict:
    """A train record's FLOPs entries (see the module docstring)."""
    rate = sum(flops.values()) / max(seconds, 1e-12) / world_size / 1e12
    return {"flops": flops, "tflops_per_gpu": rate,
            "mfu": rate / peak_tflops if peak_tflops else None}


def eval_record(step: int, loss_sum: float, tokens: float, samples: int) -> dict:
    """An evaluation's record: its loss per trained token, its tokens and samples."""
    return {"step": step, "eval_loss": loss_sum / max(tokens, 1), "eval_tokens": int(tokens),
            "eval_samples": samples}


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers by TensorBoard / W&B name: ``train/…``, ``eval_…``,
    ``forward_s/<module>``, ``anomaly/…``."""
    found: dict[str, float] = {}
    for key, value in record.items():
        if key in ("forward_s", "lrs", "flops", "memory_mibs"):
            found.update({f"{key}/{module}": s for module, s in value.items()})
        elif key == "anomaly":
            found.update({f"anomaly/{k}": float(v) for k, v in value.items()
                          if isinstance(v, (int, float))})
        elif key != "step" and isinstance(value, (int, float)):
            found[key if "eval" in key else f"train/{key}"] = float(value)
    return found


def line(record: dict, interval: Sequence[dict] = ()) -> str:
    """The stdout line of a record; ``interval``: the train records of the logging interval it
    ends (``train.log_interval`` > 1), whose loss per trained token it adds."""
    if "eval_loss" in record:
        return (f"eval step {record['step']}: loss {record['eval_loss']:.4f} over "
                f"{record['eval_tokens']} tokens of {record['eval_samples']} samples")
    forward = " ".join(f"{k} {v * 1000:.0f}ms" for k, v in record["forward_s"].items())
    skipped = "  (skipped: non-finite gradients)" if record["skipped"] else ""
    lrs = record["lrs"]
    lr = f"lr {record['lr']:.2e}" if len(set(lrs.values())) <= 1 else \
        "lr " + " ".join(f"{module} {value:.2e}" for module, value in lrs.items())
    return (f"step {record['step']:>4}: loss {record['loss']:.4f}{_interval_loss(interval)}  "
            f"grad_norm "
            f"{record['grad_norm']:.3f}  {lr}  trained tokens {record['tokens']}  "
            f"{record['tokens_per_s']:.0f} trained tok/s  " + (
                f"{record['sequence_tokens_per_s']:.0f} seq tok/s  "
                if "sequence_tokens_per_s" in record else "") +
            f"{record['samples_per_s']:.1f} samples/s  "
            f"step {record['seconds']:.2f}s{_rate(record)}  forward: {forward}" + (
                f"  data wait {record['data_wait_s'] * 1000:.0f}ms"
                if "data_wait_s" in record else "") + skipped
            + (f"  moe_aux_loss {record['moe_aux_loss']:.4f}" if "moe_aux_loss" in record
               else ""))


def _interval_loss(records: Sequence[dict]) -> str:
    """`` (steps a-b: loss)``: the loss per trained token over ``records``' steps, those
    skipped for non-finite gradients left out; empty for one step."""
    if len(records) < 2:
        return ""
    counted = _stepped(records)
    tokens = sum(r["tokens"] for r in counted)
    loss = sum(r["loss"] * r["tokens"] for r in counted) / tokens if tokens else math.nan
    return f" (steps {records[0]['step']}-{records[-1]['step']}: {loss:.4f})"


def _stepped(records: Sequence[dict]) -> list[dict]:
    """The train ``records`` of steps that updated the weights: those skipped for a non-finite
    gradient norm (or loss) left out."""
    return [r for r in records if not r.get("skipped") and math.isfinite(r["loss"])]


def _rate(record: dict) -> str:
    """The step line's TFLOP/s per GPU and MFU, where the record has them."""
    if record.get("tflops_per_gpu") is None:
        return ""
    mfu = f"  MFU {100 * record['mfu']:.1f}%" if record.get("mfu") is not None else ""
    return f"  {record['tflops_per_gpu']:.3g} TFLOP/s{mfu}"


def summary(records: list[dict]) -> str | None:
    """The run's loss, first steps against last steps, the steps skipped for a non-finite
    gradient norm (or loss) left out; None without train records."""
    steps = [r for r in records if "loss" in r]
    if not steps:
        return None
    losses = [r["loss"] for r in _stepped(steps)]
    left_out = len(steps) - len(losses)
    if not losses:
        each = "its one step was" if len(steps) == 1 else f"each of its {len(steps)} steps was"
        return (f"{PREFIX}no loss to sum up: {each} skipped (a non-finite gradient norm or "
                "loss)")
    skipped = f" ({left_out} skipped steps left out)" if left_out else ""
    if len(losses) == 1:
        return f"{PREFIX}loss of this run's one step: {losses[0]:.4f}{skipped}"
    k = max(1, min(3, len(losses) // 2))
    first, last = (("the first step", "the last step") if k == 1 else
                   (f"mean of the first {k}", f"mean of the last {k}"))
    return (f"{PREFIX}loss over this run's {len(losses)} steps: {sum(losses[:k]) / k:.4f} "
            f"({first}) -> {sum(losses[-k:]) / k:.4f} ({last}){skipped}")


WANDB_ID = "wandb_run_id"      # in checkpoint.dir: the W&B run a resumed run logs into
_ID_CHARS = string.ascii_lowercase + string.digits


def wandb_run(sdk, wandb, config: dict | None, checkpoint_dir: str | None, resumed: int):
    """The W&B run of ``train.wandb`` (``sdk``: the wandb module): ``wandb.id`` if given, else,
    with a ``checkpoint_dir``, the id kept there, so a resumed run logs into the run it
    continues (a new run writes a new id there)."""
    run_id = wandb.id
    if run_id is None and checkpoint_dir:
        path = os.path.join(checkpoint_dir, WANDB_ID)
        if resumed and os.path.isfile(path):
            with open(path) as f:
                run_id = f.read().strip() or None
        if run_id is None:
            run_id = "".join(secrets.choice(_ID_CHARS) for _ in range(8))
            write_atomic(path, run_id.encode())
    # console "off": wandb leaves stdout alone (the step lines are the run's log)
    run = sdk.init(project=wandb.project, name=wandb.name, mode=wandb.mode, dir=wandb.dir,
                   config=config, settings=sdk.Settings(console="off"),
                   **({"id": run_id, "resume": "allow"} if run_id else {}))
    logged = getattr(run, "step", 0) or 0        # what the resumed W&B run already holds
    if resumed and logged > resumed + 1:
        print(f"{PREFIX}W&B run {run_id} already holds steps up to {logged - 1} (a copied "
              f"checkpoint.dir, or an attempt that died after the checkpoint of step "
              f"{resumed}): W&B ignores this run's steps up to there; set train.wandb.id for "
              "a run of its own", flush=True)
    return run


def json_line(record: dict) -> str:
    """``record`` as one line of JSON: a NaN or infinite value (a skipped step's loss or
    gradient norm) as null, since JSON has none (Python writes ``NaN``, which jq, JavaScript
    and other strict readers refuse)."""
    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: finite(each) for key, each in value.items()}
        if isinstance(value, list | tuple):
            return [finite(each) for each in value]
        return value
    return json.dumps(finite(record), allow_nan=False) + "\n"


def drop_after(path: str, step: int) -> None:
    """Remove the records of steps after ``step`` from the records file ``path`` (a run that
    died after its last checkpoint logged them; the resumed run trains them again): the file
    rewritten at once, with a note record saying what was dropped."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return
    kept, dropped, torn = [], set(), 0
    for text in lines:
        try:
            record = json.loads(text)
        except ValueError:                  # the last line of a run killed mid-write
            torn += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) \
                and record["step"] > step:
            dropped.add(record["step"])
        else:
            kept.append(text)
    if not dropped and not torn:
        return
    span = f"{min(dropped)}-{max(dropped)}" if len(dropped) > 1 else str(min(dropped or [0]))
    what = [f"step{'s' * (len(dropped) > 1)} {span}" if dropped else "",
            f"{torn} unreadable line(s)" if torn else ""]
    note = {"step": step, "note": f"records of {' and '.join(w for w in what if w)} dropped: "
            f"the run resumed from the checkpoint of step {step} and trains the steps after "
            "it again"}
    write_atomic(path, "".join(t + "\n" for t in [*kept, json.dumps(note)]).encode())


def check_outputs(records: str | None, tensorboard_dir: str | None) -> None:
    """TrainConfigError naming each of the records file and TensorBoard's folder that rank 0,
    which writes them, cannot: found at start-up, not when the first is opened."""
    folders = [("--records", records and os.path.dirname(os.path.abspath(records)) or None),
               ("train.tensorboard_dir", tensorboard_dir)]
    problems = [f"--records {records} is a directory: give a file"] \
        if records and os.path.isdir(records) else []
    for what, folder in folders:
        if folder is None or "://" in folder:     # a URL: its writer's to make
            continue
        if in_the_way := file_in_the_way(folder):
            problems.append(f"{what}: {in_the_way} is a file, not a folder")
            continue
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as error:      # a file in the way, no permission
            problems.append(f"{what}: cannot create {folder}: {error}")
            continue
        if not os.access(folder, os.W_OK):
            problems.append(f"{what}: {folder} is not writable")
    if records and "://" not in records and not problems:
        problems += _unopenable(records)
    if problems:
        raise TrainConfigError("; ".join(problems))


def _unopenable(records: str) -> list[str]:
    """The records file opened for appending, as the run will: a folder that reads writable
    may still refuse it (root on a read-only or virtual file system, a read-only file); one
    made by this check only is removed again (a link, even to nothing, is the user's). What
    is there and no plain file (a pipe, /dev/stdout) is not opened twice: a pipe's reader
    would take the check's close for the end."""
    existed = os.path.lexists(records)
    if existed and not os.path.isfile(records) and not os.path.islink(records):
        return []
    try:
        with open(records, "a"):
            pass
    except OSError as error:
        return [f"--records: cannot write {records}: {error.strerror}: give a file in a "
                "writable folder"]
    if not existed:
        os.remove(records)
    return []


def _holds_events(folder: str) -> bool:
    """Whether a local ``folder`` holds TensorBoard event files (a bucket's is not looked at:
    a listing per run start for a note)."""
    return "://" not in folder and os.path.isdir(folder) and any(
        name.startswith("events.out.tfevents.") for name in os.listdir(folder))


def _sequence_tokens(reading: dict[str, list[float]], modules: int) -> int | None:
    """A step's sequence tokens, which follow its ``modules`` FLOPs in its reading (None:
    this rank's reading holds none)."""
    flops = reading["flops"]
    return int(flops[modules]) if len(flops) > modules else None


def _add(totals: dict[str, int], samples: int, tokens: int, sequence: int | None) -> None:
    """Add a step's samples and tokens to a run's ``totals`` (a skipped step's too: its
    samples are consumed); a total the records cannot give (a checkpoint without it; a step
    without sequence tokens) is left out from there on."""
    counted = {"samples": samples, "tokens": tokens, "sequence_tokens": sequence}
    for total, value in counted.items():
        if total in totals and value is not None:
            totals[total] += value
        else:
            totals.pop(total, None)


class Metrics:
    """Keeps the run's records; ``log`` takes a step's ``StepValues`` (read at logging steps,
    collectively: every rank calls ``log`` and ``close`` alike) or an evaluation record, prints
    the logged ones (rank 0) and writes their scalars."""

    def __init__(self, tensorboard_dir: str | None, log_interval: int, last_step: int,
                 layout, local_modules, wandb=None,
                 config: dict | None = None, memory: PeakMemory | None = None,
                 records: str | None = None, resumed: int = 0,
                 checkpoint_dir: str | None = None, consumed: dict[str, int] | None = None):
        """``resumed``: the step of the checkpoint this run resumed (0: a new run);
        ``checkpoint_dir``: where the W&B run's id is kept (``wandb_run``); ``consumed``: the
        run's totals at that step (``consumed``), as its checkpoint holds them."""
        self.rank0 = dist.get_rank() == 0
        # the run's totals since its first step, across resumes: samples, trained tokens and
        # sequence tokens (the x-axes of curves: Megatron-LM's consumed samples, HF Trainer's
        # num_input_tokens_seen); a checkpoint saved without them gives samples alone
        self.consumed: dict[str, int] = {"samples": 0, "tokens": 0, "sequence_tokens": 0} \
            if not resumed else dict(consumed or {})
        # each record is written as it is read, so a run that dies keeps its steps' records;
        # a resumed run adds to those of the runs before it, less the steps it trains again
        if records and self.rank0 and resumed:
            drop_after(records, resumed)
        self.file = open(records, "a" if resumed else "w", buffering=1) \
            if records and self.rank0 else None
        self.log_interval, self.last_step = log_interval, last_step
        self.layout, self.local_modules = layout, local_modules
        self.memory = memory
        self.records: list[dict] = []
        self.peak_tflops: float | None = None      # MFU's denominator (the trainer's)
        self.pending: list[StepValues] = []
        # records read and not yet written to TensorBoard / W&B (``publish``: in step order,
        # which W&B needs: it drops a step logged after a later one)
        self.unwritten: list[dict] = []
        self.writer = None
        if tensorboard_dir and self.rank0:
            from torch.utils.tensorboard import SummaryWriter
            # The steps this run logs (from resumed + 1: the first step it trains) replace
            # those an earlier run logged in the same folder, a run that died after the
            # checkpoint resumed or, for a new run, one that died before its first checkpoint.
            if not resumed and _holds_events(tensorboard_dir):
                print(f"{PREFIX}train.tensorboard_dir {tensorboard_dir} holds an earlier run's "
                      "events: TensorBoard shows this new run's steps in their place (give "
                      "another folder to keep both)", flush=True)
            self.writer = SummaryWriter(tensorboard_dir, purge_step=resumed + 1)
        self.wandb = None                 # train.wandb (a WandbConfig): its run, on rank 0
        if wandb is not None and self.rank0:
            import wandb as wandb_sdk
            if wandb.dir:
                os.makedirs(wandb.dir, exist_ok=True)
            self.wandb = wandb_run(wandb_sdk, wandb, config, checkpoint_dir, resumed)

    def log(self, values: StepValues | dict) -> list[dict]:
        """The train records read now (the pending steps' at a logging step)."""
        if isinstance(values, dict):                   # an evaluation record: read already
            read = self.flush(show=True)               # its step's line first
            self._keep([values])
            self.unwritten.append(values)
            self._show(values)
            return read
        self.pending.append(values)
        if values.step % self.log_interval == 0 or values.step == self.last_step:
            read = self.flush()
            self._show(read[-1], read)
            return read
        return []

    def unfinished(self, values: StepValues) -> None:
        """Say a step done when the run failed before its line: a line's figures are gathered
        over the ranks (``flush``), which a failed rank no longer joins, so rank 0 says what
        it holds itself, the world's loss and trained tokens (its pending steps between
        logging steps stay unsaid, as they would have)."""
        if not self.rank0 or values.step % self.log_interval or not values.readings.ready():
            return                  # (never a wait: the failed step's work may never end)
        loss_sum, tokens = values.readings.read()["sums"]
        print(f"step {values.step:>4}: loss {loss_sum / max(tokens, 1):.4f}  trained tokens "
              f"{int(tokens)}  (its other figures not gathered: the run failed in the next "
              "step)", flush=True)

    def log_anomaly(self, record: dict) -> None:
        """A skipped or spiking step's record (``anomalies``), its samples included."""
        self.flush()
        self._keep([record])
        if self.rank0:
            anomaly = record["anomaly"]
            keys = ", ".join(s["key"] for s in anomaly["samples"][:8])
            more = len(anomaly["samples"]) - 8
            print(f"step {record['step']:>4}: {anomaly['reason']}; samples {keys}"
                  + (f" and {more} more" if more > 0 else "") + " (in the records)", flush=True)
        self.unwritten.append(record)

    def flush(self, show: bool = False) -> list[dict]:
        """Read the pending steps into records (collective: a reduction over the control
        group); returns them. ``show``: the last one's line too (a run stopping between logging
        steps says the step it stopped after before it says why; an evaluation between them
        says the step it follows)."""
        if not self.pending:
            return []
        if show:
            read = self.flush()
            self._show(read[-1], read)
            return read
        pending, self.pending = self.pending, []
        unsettled = [p.step for p in pending if p.lrs is None]
        if unsettled:
            raise RuntimeError(f"steps {unsettled} logged before the trainer settled them")
        readings = [p.readings.read() for p in pending]
        names = [m.name for m in self.layout.modules]
        # per module: its learning rate (-1 where this rank does not train it), its forward
        # seconds, its peak memory; the rank's wait for its micro-batches; the world's maxima
        local = [[(p.lrs or {}).get(name, -1.0) for name in names]
                 + [sum(t.seconds() for t in p.forward) if name in self.local_modules
                    else 0.0 for name in names]
                 + [p.memory_mib if name in self.local_modules else 0.0 for name in names]
                 + [p.data_wait] + reading.get("balance", [-1.0])
                 for p, reading in zip(pending, readings)]
        # host values: over the control group, so the reduction waits for no device queue
        maxima = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=distributed.control())
        read = []
        for p, reading, row in zip(pending, readings, maxima.tolist()):
            loss_sum, tokens = reading["sums"]
            lrs = {name: lr for name, lr in zip(names, row) if lr >= 0}
            read.append(train_record(
                p.step, loss_sum, tokens, p.grad_norm, lrs, p.skipped, p.timer.seconds(),
                p.global_batch_size,
                per_module(self.layout, row[len(names):2 * len(names)]),
                per_module(self.layout, row[2 * len(names):3 * len(names)])
                if self.memory is not None else None, row[3 * len(names)]))
            if row[-1] >= 0:                    # a value of the language ranks' (>= 0)
                read[-1]["moe_aux_loss"] = row[-1]
        world = dist.get_world_size()
        for record, reading in zip(read, readings):
            flops = reading["flops"]
            sequence = _sequence_tokens(reading, len(names))
            if sequence is not None:
                record.update(sequence_tokens=sequence,
                              sequence_tokens_per_s=sequence / record["seconds"])
            record.update(flops_fields(dict(zip(names, flops)), record["seconds"], world,
                                       self.peak_tflops))
        for record, p in zip(read, pending):
            _add(self.consumed, p.global_batch_size, record["tokens"],
                 record.get("sequence_tokens"))
            record.update({f"consumed_{total}": value
                           for total, value in self.consumed.items()})
        self._keep(read)
        self.unwritten += read              # every step's, not only the logged ones'
        return read

    def totals(self) -> dict[str, int]:
        """The run's totals to its last settled step, those of the steps not logged yet
        included (their readings are read: the device has run them), for a checkpoint's
        ``consumed``: a copy, which later steps leave as it is."""
        totals = dict(self.consumed)
        for p in self.pending:
            reading = p.readings.read()
            _add(totals, p.global_batch_size, int(reading["sums"][1]),
                 _sequence_tokens(reading, len(self.layout.modules)))
        return totals

    def publish(self) -> None:
        """The records read since the last call to TensorBoard and W&B (rank 0), in step order:
        a step's train record, then what was logged of it later (its evaluation, its anomaly).
        The trainer calls it once it has logged the anomalies of the steps it read."""
        unwritten, self.unwritten = self.unwritten, []
        for record in sorted(unwritten, key=lambda r: r["step"]):
            self._write(record["step"], scalars(record))

    def _keep(self, records: list[dict]) -> None:
        self.records += records
        if self.file is not None:
            self.file.writelines(json_line(record) for record in records)

    def _show(self, record: dict, interval: Sequence[dict] = ()) -> None:
        """``record``'s line (rank 0); ``interval``: as ``line``'s."""
        if self.rank0:
            print(line(record, interval), flush=True)

    def _write(self, step: int, values: dict[str, float]) -> None:
        """``values`` to TensorBoard and W&B (rank 0)."""
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        self.flush()
        self.publish()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.file is not None:
            self.file.close()
        text = summary(self.records)
        if text and self.rank0:
            print(text, flush=True)
