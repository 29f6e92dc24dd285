"""The device a rank trains on (``train.device``), and why CUDA is unusable when it is.

``auto`` means CUDA when it works, the CPU when the machine has no GPU. A machine whose GPUs
are visible (``/dev/nvidia<N>`` or ``/proc/driver/nvidia/gpus``, not hidden by
``CUDA_VISIBLE_DEVICES``) but where CUDA does not start (the torch wheel is a CUDA build that
needs a recent enough driver: a CUDA 13.0 wheel needs driver 580 or newer) is an error naming
torch's reason, the driver and the wheel, and the ways out, never a silent CPU run. The
ranks of a job train on one kind of device (``mixed``).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

import torch

from mimo_train.errors import TrainConfigError
from mimo_train.runtime.distributed import FAILING

# The oldest Linux driver branch each CUDA major version runs on (minor-version compatibility;
# NVIDIA's CUDA toolkit release notes, table 3).
_MIN_DRIVER = {"11": "450.80.02", "12": "525.60.13", "13": "580.65.06"}


@dataclass(frozen=True)
class CudaState:
    """What this machine shows of CUDA (``probe()``; tests make their own)."""
    usable: bool                    # torch.cuda.is_available()
    gpus: tuple[str, ...]           # the GPU device nodes or driver entries seen
    failure: str | None             # torch's reason when CUDA does not start
    driver: str | None              # the kernel driver's version, when readable
    wheel_cuda: str | None          # torch.version.cuda (None: a CPU-only wheel)
    count: int = 1                  # torch.cuda.device_count() where CUDA works


def probe() -> CudaState:
    usable = torch.cuda.is_available()
    failure = None
    if not usable:
        try:
            torch.cuda.init()
        except (RuntimeError, AssertionError) as error:
            failure = str(error).strip().splitlines()[0] if str(error).strip() else None
    return CudaState(usable, _visible_gpus(), failure, _driver_version(), torch.version.cuda,
                     torch.cuda.device_count() if usable else 0)


def _visible_gpus() -> tuple[str, ...]:
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return ()
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*")) or sorted(
        glob.glob("/proc/driver/nvidia/gpus/*"))
    return tuple(nodes)


def _driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", f.read())
    except OSError:
        return None
    return found[1] if found else None


def unusable_cuda(state: CudaState) -> str | None:
    """Why CUDA cannot be used although GPUs are visible; None when it works or none is."""
    if state.usable or not state.gpus:
        return None
    wheel_fix = ("install a torch wheel built for the CUDA your driver supports (pip install "
                 "torch --index-url https://download.pytorch.org/whl/cu126, for example)")
    if state.wheel_cuda:
        minimum = _MIN_DRIVER.get(state.wheel_cuda.split(".")[0], "a recent one")
        wheel = (f"this torch {torch.__version__} is a CUDA {state.wheel_cuda} build, which "
                 f"needs NVIDIA driver {minimum} or newer")
        fixes = f"update the NVIDIA driver; or {wheel_fix}"
    else:
        wheel = f"this torch {torch.__version__} is a CPU-only build"
        fixes = wheel_fix
    return (f"{len(state.gpus)} NVIDIA GPU(s) are visible ({', '.join(state.gpus[:4])}) but "
            f"CUDA does not start: {state.failure or 'torch.cuda.is_available() is False'}; "
            f"{wheel}; the driver is {state.driver or 'unknown (no /proc/driver/nvidia)'}. Fix "
            f"one: {fixes}; or train on the CPU on purpose: CUDA_VISIBLE_DEVICES= torchrun ... "
            "train.device=cpu")


def select(setting: str, state: CudaState) -> tuple[torch.device, Exception | None]:
    """The device for ``train.device`` and the error to report once the ranks have joined
    (the CPU stands in while the error travels)."""
    problem = unusable_cuda(state)
    if setting == "cuda" and not state.usable:
        return torch.device("cpu"), TrainConfigError(
            f"train.device is cuda: {problem}" if problem else
            "train.device is cuda but no CUDA device is visible: use train.device=cpu or auto")
    if setting == "cpu" and state.usable:
        # cpu_compat (megatron-core on CPU) switches on only without CUDA (mcore.py)
        return torch.device("cpu"), TrainConfigError(
            "train.device is cpu but CUDA devices are visible: hide them "
            "(CUDA_VISIBLE_DEVICES= torchrun ...) to train on the CPU")
    if state.usable:
        # every rank of the node sees the same count, so they all stop together (NCCL refuses
        # two ranks on one GPU; a rank past the last GPU would have no device)
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if per_node > state.count:
            return torch.device("cpu"), TrainConfigError(
                f"this node runs {per_node} ranks but has {state.count} visible GPU(s): one "
                f"rank per GPU; start at most {state.count} ranks per node (torchrun "
                f"--nproc-per-node {state.count}) with a layout of that many ranks, or more "
                "nodes")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), None
    if setting == "auto" and problem:
        return torch.device("cpu"), TrainConfigError(f"train.device is auto: {problem}")
    return torch.device("cpu"), None


def mixed(kinds: list[str] | None) -> TrainConfigError | None:
    """An error where the ranks' devices (``distributed.device_types``) are not all of one kind:
    a node without usable GPUs in a job of GPU nodes (``auto`` takes its CPU; a node whose CUDA
    failed says why in its own line). Ranks that joined only to report their own failure
    (``distributed.FAILING``) are not counted: their failure is the message."""
    by_kind: dict[str, list[int]] = {}
    for rank, kind in enumerate(kinds or []):
        if kind != FAILING:
            by_kind.setdefault(kind, []).append(rank)
    if len(by_kind) < 2:
        return None
    found = "; ".join(f"rank(s) {ranks} on {kind}" for kind, ranks in sorted(by_kind.items()))
    return TrainConfigError(
        f"the ranks are on different kinds of device ({found}): every rank trains on its own "
        "GPU or every rank on the CPU; make the GPUs of the other ranks' nodes usable "
        "(nvidia-smi there), or start the job on nodes that have them")
