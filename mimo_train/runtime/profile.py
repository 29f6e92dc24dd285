"""Where a step's time goes: torch.profiler over a few steps, summarized in a small dict.

``Profile`` (``train.profile``) wraps steps ``start .. start + steps - 1`` of a run (after a
lead-in step, profiled but not summarized) in ``torch.profiler.profile`` and writes
``profile_rank{R}.json`` (and, with ``trace``, the Chrome trace beside it). ``summarize``
turns a finished profiler into the figures that choose the next change, the same for mimo and
for any other training measured beside it (``tools/gpu_check/peer.py``):

- ``shares``: the share of device time in matmuls (convolutions too), attention, elementwise
  and norm kernels, communication and copies, and ``idle``: the profiled steps' wall time no
  kernel covers, the host's time before a step's first kernel and after its last included
  (on a GPU; on a CPU the shares are of the operators' own CPU time and there is no idle);
- ``top``: the kernels (operators on a CPU) with the most time, ``top_by_kind`` the first
  ``KIND_TOP`` of each kind (which elementwise kernels the elementwise share is) and
  ``top_by_calls`` the most launched (what makes the host's launches many), each with its
  calls a step;
- ``host_reads_per_step``: values read on the host (``.item()`` and friends:
  ``aten::_local_scalar_dense``; ``cuda*Synchronize``) per profiled step, and
  ``host_reads_by_call`` by name: of device and host tensors alike (torch's Adam reads its
  host-side step counts twice a parameter), so not all of them wait for the GPU;
- ``operators_per_step``: the operators the host dispatched (outermost ``aten::`` calls, each
  one kernel launch or more on a GPU: the host's share of a step grows with them, and the GPU
  idles when the host falls behind), and on a GPU ``kernels_per_step``;
- ``host_ms_by_phase`` and on a GPU ``idle_ms_by_phase``: the profiled steps' wall time,
  and the GPU's idle time in them, by what the host was doing (the ``PHASES`` the trainer
  marks with ``mark_phase``: fetching and placing a micro-batch, dispatching its forward pass, the
  rest of a training pass's schedule (the backward passes, the loss, the gradients'
  reduction), the optimizer's step with the gradient norm and the learning rate's; ``step``
  for the rest: zeroing the gradients, the step's loss sum across ranks, the records, an
  evaluation's passes): idle time under
  ``forward`` says the host's dispatch is behind the GPU there, under ``optimizer`` that a
  wait drained the GPU's queue (mimo's step reads only the step before's host copy there:
  ``Trainer.settle``), under ``step`` that the step's own Python is;
- ``host_syncs_per_step`` and ``sync_sites`` (``Profile``): the waits themselves, counted at
  their innermost Python frame outside torch: on CUDA each call torch's sync debug mode
  reports (``SyncSites``), on the CPU with ``train.profile.waits`` each operator that would
  wait on a GPU (``HostWaits``; an upper bound: tensors that stay on the host in a GPU run
  count too).

torch.profiler records; nothing in it sorts kernels into these kinds, hence ``kind``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import traceback
from collections import Counter
import warnings
from typing import Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# kernel or operator name -> kind; the first pattern that matches wins (a convolution is a
# matmul: cuDNN's and oneDNN's run it as one, and a tower's patch embedding is one)
KINDS = (
    ("communication", re.compile(r"nccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|"
                                 r"broadcast|all_to_all", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|varlen|chunk_gated_delta|"
                             r"fused_recurrent|delta_rule", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm\d\d_|addmm|aten::mm$|"
                          r"aten::bmm|aten::baddbmm|aten::_grouped_mm|matmul|linear|convolution|convolve|"
                          r"conv[123]d", re.I)),
    ("copy", re.compile(r"memcpy|memset|aten::copy_|aten::to$|aten::_to_copy|aten::cat$|"
                        r"CatArray", re.I)),
)
TORCH = os.path.dirname(torch.__file__) + os.sep     # frames inside torch are not sites
SYNCS = re.compile(r"aten::_local_scalar_dense|cuda(Stream|Device|Event)Synchronize")
# dispatch keys the CPU profiler times as operators where the time is Python's (a mode's)
PYTHON_KEYS = frozenset({"PythonDispatchMode"})
MODE_HOOKS = ("__torch_function__", "__torch_dispatch__")   # a mode's frame: not a site
# operators that hand the host a value or whose output's size depends on the data
WAITING_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::bincount", "aten::equal",
    "aten::masked_scatter_backward"})      # a masked_select of the gradient (CUDA: nonzero)


# the phases of a step that ``mark_phase`` marks, innermost first (where marks nest, the time is
# the innermost one's): a micro-batch's fetch and placement, its forward pass's dispatch, the
# rest of the schedule or the backward passes, the optimizer's step; "step" is the rest
PHASES = ("data", "forward", "backward", "optimizer")
MARK = "phase: "
LEAD_IN = "ProfilerLeadIn"      # the mark of the step profiled before the summarized ones


def mark_phase(name: str) -> contextlib.AbstractContextManager:
    """The host's ``name`` (one of ``PHASES``) marked in a profile: a range of torch's
    profiler (while none records, one profiler call of a few microseconds, no kernel)."""
    if name not in PHASES:
        raise ValueError(f"no phase {name!r}: one of {PHASES}")
    return torch.profiler.record_function(MARK + name)


def painted(spans: list[tuple[float, float]], marks: list[tuple[float, float, str]]
            ) -> dict[str, float]:
    """The time of ``spans`` (start, end) under each phase of ``marks`` (start, end, phase):
    the innermost one (``PHASES``' order) where marks overlap, ``step`` where none does."""
    order = {name: i for i, name in enumerate(PHASES)}
    found = dict.fromkeys((*PHASES, "step"), 0.0)
    for start, end in spans:
        inside = [m for m in marks if m[0] < end and m[1] > start]
        cuts = sorted({start, end, *(t for s, e, _ in inside for t in (s, e) if start < t < end)})
        for a, b in zip(cuts, cuts[1:]):
            covering = [name for s, e, name in inside if s <= a and e >= b]
            found[min(covering, key=order.__getitem__) if covering else "step"] += b - a
    return found


def _gaps(spans: list[tuple[float, float]], start: float, end: float
          ) -> list[tuple[float, float]]:
    """The parts of ``start .. end`` that no span of ``spans`` covers."""
    gaps, reached = [], start
    for s, t in sorted(spans):
        if s > reached:
            gaps.append((reached, min(s, end)))
        reached = max(reached, t)
    if reached < end:
        gaps.append((reached, end))
    return [(s, t) for s, t in gaps if t > s]


def kind(name: str) -> str:
    """The kind of a kernel or operator by its name; ``elementwise`` (norms, activations,
    rotary, optimizer, reductions) where no pattern matches."""
    for label, pattern in KINDS:
        if pattern.search(name):
            return label
    return "elementwise"


def parent_names(event) -> list[str]:
    """The names of the operators and ranges a profiler ``event`` ran inside, innermost
    first."""
    names, parent = [], getattr(event, "cpu_parent", None)
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def _outermost_operators(events) -> int:
    """``aten::`` calls not made inside another one (its children are its own work)."""
    return sum(1 for e in events if e.name.startswith("aten::")
               and e.device_type == torch.autograd.DeviceType.CPU
               and not any(name.startswith("aten::") for name in parent_names(e)))


KIND_TOP = 6                    # top_by_kind: the kernels (operators) listed of each kind


def step_marks(events) -> list:
    """The summarized steps' marks (``Profile``'s; torch reads "#N" as "*"): what ran before
    the first of them is the lead-in's."""
    return [e for e in events if e.name.startswith("ProfilerStep")
            and e.device_type == torch.autograd.DeviceType.CPU]


def summarize(profiler: torch.profiler.profile, steps: int, top: int = 8) -> dict:
    """The figures of a finished profiler that covered ``steps`` steps (times in ms per
    step)."""
    events = profiler.events()
    # the lead-in left out, but for its kernels' time in the window
    stepped = step_marks(events)
    begun = min((e.time_range.start for e in stepped), default=-math.inf)
    events = [e for e in events if e.time_range.start >= begun or (
        e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > begun)]
    # kernels and copies on the device; not the ranges that annotate them there (an optimizer
    # step's, a profiler step's), which overlap them
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    synced = [e for e in events if SYNCS.search(e.name) and e.time_range.start >= begun]
    if kernels:
        device = "cuda"
        timed = [(e.name, max(e.time_range.start, begun), e.time_range.end) for e in kernels]
        # the steps' wall time (their marks) and the kernels that end after it
        spans = [(s, t) for _, s, t in timed] + [
            (e.time_range.start, e.time_range.end) for e in stepped]
        first, last = min(s for s, _ in spans), max(t for _, t in spans)
        window = last - first
        own: dict[str, float] = {}
        for name, start, stop in timed:
            own[name] = own.get(name, 0.0) + (stop - start)
        calls = Counter(name for name, _, _ in timed)
        gaps = _gaps([(s, t) for _, s, t in timed], first, last)       # no kernel running
        idle = sum(t - s for s, t in gaps)
        busy = window - idle
    else:           # the CPU: each operator's own time (children not counted twice); not
        # the Python in annotated ranges (the data loader's, the optimizer step's) nor a
        # dispatch mode's own Python (HostWaits), which are no operator's
        device = "cpu"
        own, calls = {}, Counter()
        for e in events:          # (torch's key_averages, but of the window's events alone)
            if not e.is_user_annotation and e.name not in PYTHON_KEYS and \
                    not e.name.startswith(("ProfilerStep", LEAD_IN)):
                own[e.name] = own.get(e.name, 0.0) + e.self_cpu_time_total
                calls[e.name] += 1
        own = {name: spent for name, spent in own.items() if spent > 0}
        calls = Counter({name: calls[name] for name in own})
        window, idle = sum(own.values()), 0.0
    spent: dict[str, float] = {}
    for name, microseconds in own.items():
        label = kind(name)
        spent[label] = spent.get(label, 0.0) + microseconds
    whole = (sum(spent.values()) + idle) or 1.0
    shares = {label: round(spent.get(label, 0.0) / whole, 4)
              for label in ("matmul", "attention", "elementwise", "communication", "copy")}
    if device == "cuda":
        shares["idle"] = round(idle / whole, 4)
    per_step = max(steps, 1) * 1000.0

    def entry(name: str, value: float) -> dict:
        return {"name": name[:120], "kind": kind(name), "ms_per_step": round(value / per_step, 3),
                "share": round(value / whole, 4),
                "calls_per_step": round(calls[name] / max(steps, 1), 1)}
    ranked = sorted(own.items(), key=lambda item: -item[1])
    by_kind: dict[str, list[dict]] = {}
    for name, value in ranked:
        listed = by_kind.setdefault(kind(name), [])
        if len(listed) < KIND_TOP:
            listed.append(entry(name, value))
    # the host's phases: the marks of the steps' thread (not their copies on the GPU's
    # timeline, nor another thread's, whose time overlaps the steps')
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    threads = {getattr(e, "thread", None) for e in stepped}
    marks = [(e.time_range.start, e.time_range.end, e.name[len(MARK):]) for e in host
             if e.name.startswith(MARK) and getattr(e, "thread", None) in threads]
    phases = {}
    if marks:
        phases["host_ms_by_phase"] = painted(
            [(e.time_range.start, e.time_range.end) for e in stepped], marks)
        if kernels:
            phases["idle_ms_by_phase"] = painted(gaps, marks)
    phases = {key: {name: round(us / per_step, 3) for name, us in found.items()}
              for key, found in phases.items()}
    return {"device": device, "steps": steps, "ms_per_step": round(window / per_step, 3),
            "shares": shares,
            "top": [entry(name, value) for name, value in ranked[:top]],
            "top_by_kind": by_kind,
            "top_by_calls": [entry(name, own[name]) for name, _ in calls.most_common(top)],
            "operators_per_step": round(_outermost_operators(events) / max(steps, 1), 1),
            **({"kernels_per_step": round(len(kernels) / max(steps, 1), 1),
                # time some kernel ran: against the unprofiled steps' time (the GPU check's
                # busy_over_timed), whether the GPU or the host bounds a step
                "busy_ms_per_step": round(busy / per_step, 3)} if kernels else {}),
            **phases,
            "host_reads_per_step": round(len(synced) / max(steps, 1), 2),
            "host_reads_by_call": {name: round(n / max(steps, 1), 2) for name, n in sorted(
                Counter(e.name for e in synced).items(), key=lambda item: -item[1])}}


class Window(Protocol):
    """Which steps to profile and where to write (``train.profile``, a ``ProfileConfig``)."""
    dir: str
    start: int
    steps: int
    trace: bool
    waits: bool                     # on the CPU: HostWaits (slow)


class SyncSites:
    """Where the host waits for the device, on CUDA: torch's sync debug mode warns at every
    synchronizing call; each warning's innermost Python frame outside torch is counted."""

    def __init__(self) -> None:
        self.sites: dict[str, int] = {}
        self._guard = warnings.catch_warnings()

    def __enter__(self) -> SyncSites:
        self._guard.__enter__()            # the filters and showwarning, restored at exit
        self._shown = warnings.showwarning
        warnings.simplefilter("always")
        warnings.showwarning = self._seen
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._guard.__exit__(None, None, None)

    def _seen(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):       # other warnings shown as before
            self._shown(message, category, filename, lineno, file, line)
            return
        self.count()

    def count(self, call: str = "") -> None:
        """Count one wait at the innermost Python frame outside torch, this module and
        torch's modes (and the call that waits, where known)."""
        frames = [f for f in traceback.extract_stack()[:-1]
                  if not f.filename.startswith(TORCH) and f.filename != __file__
                  and not f.filename.endswith("warnings.py") and f.name not in MODE_HOOKS]
        site = f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].name}" if frames \
            else "(no Python frame)"
        site += f" [{call}]" if call else ""
        self.sites[site] = self.sites.get(site, 0) + 1

    def top(self, steps: int, count: int = 8) -> list[dict]:
        ranked = sorted(self.sites.items(), key=lambda item: -item[1])[:count]
        return [{"site": site[-200:], "per_step": round(n / max(steps, 1), 2)}
                for site, n in ranked]


def _waits(func, args: tuple, kwargs: dict) -> bool:
    """Whether an operator makes the host wait for a GPU: it hands the host a value, or the
    size of its output depends on the data."""
    name = func.name()
    if name in WAITING_OPS:
        return True
    if name in ("aten::index.Tensor", "aten::index_put_", "aten::index_put"):
        masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
        if name != "aten::index.Tensor" and len(masks) == len(
                [i for i in args[1] if i is not None]) == 1 and args[2].numel() == 1:
            return False        # ``x[mask] = value``: torch makes it a masked_fill_, no wait
        return bool(masks)
    if name in ("aten::repeat_interleave.Tensor", "aten::repeat_interleave.self_Tensor"):
        return kwargs.get("output_size") is None
    return False


class HostWaits(SyncSites):
    """``SyncSites`` on the CPU, where nothing waits: each operator that would make the host
    wait on a GPU (``WAITING_OPS``; indexing by a mask; ``repeat_interleave`` without its
    output size; ``Tensor.tolist``), counted at its Python caller. Tensors that stay on the
    host in a GPU run count too: a map of where to look, not the GPU's figure. torch's sync
    debug mode is CUDA-only; a dispatch mode sees every operator (inside autograd's backward
    too), a function mode ``tolist`` (which dispatches nothing on the CPU)."""

    def __enter__(self) -> HostWaits:
        sites = self

        class Operators(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if _waits(func, args, kwargs or {}):
                    sites.count(func.name())
                return func(*args, **(kwargs or {}))

        class Methods(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.Tensor.tolist:
                    sites.count("tolist")
                return func(*args, **(kwargs or {}))

        self._modes = (Methods(), Operators())
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)


class Profile:
    """Steps ``window.start .. + window.steps - 1`` of this rank under torch.profiler:
    ``before(step)`` before each step, ``after(step)`` after it, within ``with profile:``
    (the run's steps). The profiler starts a step earlier (the lead-in, not summarized): its
    start waits for the GPU, whose queue the host then refills, so the window's first step
    starts as the others run, the host ahead of the GPU, not with an empty queue."""

    def __init__(self, window: Window | None, rank: int, device: torch.device):
        self.window, self.rank, self.device = window, rank, device
        self.profiler: torch.profiler.profile | None = None
        self.syncs: SyncSites | None = None
        self.mark: torch.profiler.record_function | None = None
        self.done = 0

    def before(self, step: int) -> None:
        if self.window is None:
            return
        lead_in = step == self.window.start - 1
        if self.profiler is None:
            if step != self.window.start and not lead_in:
                return
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cpu":
                # a CUDA build of torch on a machine without a GPU: its profiler library
                # (kineto) logs "gpuGetDeviceCount failed" as an ERROR line from every rank,
                # for a device this run does not use (read when the profiler starts)
                os.environ.setdefault("KINETO_LOG_LEVEL", "5")
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize(self.device)
            self.profiler = torch.profiler.profile(activities=activities, acc_events=True)
            self.profiler.__enter__()
        if step == self.window.start and (self.device.type == "cuda" or self.window.waits):
            self.syncs = (SyncSites() if self.device.type == "cuda"
                          else HostWaits()).__enter__()
        # each step's range, which summarize's window spans: torch.profiler marks steps
        # (ProfilerStep#N) only under a schedule, which a window of consecutive steps needs not
        self.mark = torch.profiler.record_function(
            f"{LEAD_IN if lead_in else 'ProfilerStep'}#{step}")
        self.mark.__enter__()

    def _unmark(self) -> None:
        if self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None

    def after(self, step: int) -> None:
        if self.profiler is None or self.window is None:
            return
        self._unmark()
        if step < self.window.start:                    # the lead-in
            return
        self.done += 1
        if self.done == self.window.steps:
            self.finish()

    def __enter__(self) -> Profile:
        return self

    def __exit__(self, kind, error, trace) -> None:
        """The run's end: the window written (also when the run ended before its last
        step); after a step that raised, torch's profiler and modes (on CUDA, its sync debug
        mode) stopped and nothing written: no summary of a step cut short, and no wait for a
        device that may have failed."""
        if kind is None:
            self.finish()
        elif self.profiler is not None:
            try:
                self._stop(wait=False)
            except Exception:       # torch's profiler syncs the device: a failed one raises
                pass                # again, and the step's error is the one to report
            self.profiler = self.syncs = None

    def _stop(self, wait: bool) -> None:
        assert self.profiler is not None
        try:
            self._unmark()
            if self.syncs is not None:
                self.syncs.__exit__(None, None, None)
            if wait and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:                    # torch's profiler stopped whatever failed before it
            self.profiler.__exit__(None, None, None)

    def finish(self) -> None:
        """Stop and write (nothing where the run ended on the lead-in: no step of the window
        ran)."""
        if self.profiler is None or self.window is None:
            return
        self._stop(wait=True)
        if self.done == 0:
            self.profiler = self.syncs = None
            return
        os.makedirs(self.window.dir, exist_ok=True)
        path = os.path.join(self.window.dir, f"profile_rank{self.rank}")
        if self.window.trace:
            self.profiler.export_chrome_trace(path + ".trace.json")
        summary = {"rank": self.rank, "first_step": self.window.start,
                   **summarize(self.profiler, self.done)}
        if self.syncs is not None:
            summary["host_syncs_per_step"] = round(
                sum(self.syncs.sites.values()) / max(self.done, 1), 2)
            summary["sync_sites"] = self.syncs.top(self.done, count=12)
            self.syncs = None
        with open(path + ".json", "w") as out:
            json.dump(summary, out, indent=1)
        self.profiler = None
