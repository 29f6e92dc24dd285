"""Joining the ``torchrun`` job, and the CPU group that carries control messages.

Training collectives run on the default group: NCCL on GPUs, gloo on the CPU. Start-up
agreement, failure reports and the token-table parts go over a separate gloo group of every
rank (``control``): they move Python objects through CPU memory, so a rank whose GPU is in a
CUDA error still joins them and every rank prints one message, where the NCCL default group
would leave the others waiting for its watchdog. Both groups time out after
``train.collective_timeout_minutes``: a collective that a rank never joins fails with an error
instead of hanging.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

_control: dist.ProcessGroup | None = None


def init(device: torch.device, timeout_minutes: float | None = None) -> None:
    """Join the ``torchrun`` job (env://), or start a one-process group without torchrun;
    then make the control group (collective)."""
    global _control
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict = {}
    if timeout_minutes is not None:
        kwargs["timeout"] = timedelta(minutes=timeout_minutes)
    if device.type == "cuda":
        # With NCCL, binding the group to this rank's GPU tells barrier() (checkpoint saves)
        # which device to use instead of guessing (torch warns at every barrier otherwise).
        kwargs["device_id"] = device
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, **kwargs)
    _control = dist.new_group(backend="gloo", timeout=kwargs.get("timeout"))


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
