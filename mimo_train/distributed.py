"""Joining the ``torchrun`` job, and the CPU group that carries control messages.

Training collectives run on the default group: NCCL on GPUs, gloo on the CPU. Start-up
agreement, failure reports and the token-table parts go over a separate gloo group of every
rank (``control``): they move Python objects through CPU memory, so a rank whose GPU is in a
CUDA error still joins them and every rank prints one message, where the NCCL default group
would leave the others waiting for its watchdog. Both groups time out after
``train.collective_timeout_minutes`` (the trainer gives the modules' groups the same): a
collective that a rank never joins fails with an error instead of hanging.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

_control: dist.ProcessGroup | None = None


def init(device: torch.device, timeout: timedelta | None = None) -> None:
    """Join the ``torchrun`` job (env://), or start a one-process group without torchrun,
    unless the process is in a job already; then make the control group if it has none
    (collective)."""
    global _control
    kwargs: dict = {} if timeout is None else {"timeout": timeout}
    if not dist.is_initialized():
        _join("nccl" if device.type == "cuda" else "gloo", device, kwargs)
    if _control is None:
        _control = dist.new_group(backend="gloo", **kwargs)


def _join(backend: str, device: torch.device, kwargs: dict) -> None:
    if device.type == "cuda":
        # With NCCL, binding the group to this rank's GPU tells barrier() (checkpoint saves)
        # which device to use instead of guessing (torch warns at every barrier otherwise).
        torch.cuda.set_device(device)
        kwargs = {**kwargs, "device_id": device}
    if "RANK" in os.environ:
        dist.init_process_group(backend, **kwargs)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, **kwargs)


def control() -> dist.ProcessGroup | None:
    """The control group (None before ``init``)."""
    return _control


def gather(value) -> list:
    """``value`` of every rank, in rank order, over the control group (collective; the
    default group before ``init``, e.g. a failure before the trainer starts)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=_control)
    return gathered


def barrier() -> None:
    """Wait for every rank, over the control group."""
    dist.barrier(group=_control)


def destroy() -> None:
    """Leave the job: the control group and the default group."""
    global _control
    _control = None
    if dist.is_initialized():
        dist.destroy_process_group()
