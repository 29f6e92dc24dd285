"""Joining the ``torchrun`` job, and the CPU group that carries control messages: the one place
mimo_train makes process groups besides the modules' grids (``mcore.grids``).

Training collectives run on the default group: NCCL on GPUs, gloo on the CPU. Control traffic
(start-up agreement, failure reports, the token-table parts, checkpoint coordination and
verdicts, anomaly samples, exit signals) goes over a separate gloo group of every rank
(``control``): it moves Python objects through CPU memory, so a rank whose GPU is in a CUDA
error still joins it and every rank prints one message, where the NCCL default group would
leave the others waiting for its watchdog (and make each object a device round trip). Both
groups time out after ``train.collective_timeout_minutes`` (the trainer gives the modules'
groups the same, and groups made later without a timeout get it too: megatron-core's bridge
between modules makes its own, which torch would give its 30-minute default): a collective
that a rank never joins fails with an error instead of hanging.

Before joining, the ranks tell each other their device through torchrun's store
(``device_types``): NCCL only where every rank has its GPU, else gloo on every rank, so that a
job whose nodes differ (one without usable GPUs) can say so (``devices.mixed``) instead of its
GPU ranks waiting in NCCL's set-up and the others in gloo's until the timeout.
"""

from __future__ import annotations

import functools
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from mimo_train.errors import StartupError

_control: dist.ProcessGroup | None = None
# torchrun's store key of a rank's device type, per attempt and per join of this process
_DEVICE_KEY = "mimo_train/device/{attempt}/{join}/{rank}"
FAILING = "failing"         # the device kind of a rank that joins to report a failure
_joins = 0


def init(device: torch.device, timeout: timedelta | None = None,
         failing: bool = False) -> list[str] | None:
    """Join the ``torchrun`` job (env://), or start a one-process group without torchrun,
    unless the process is in a job already; then make the control group if it has none
    (collective). Returns every rank's device type where it joined a torchrun job of several
    ranks (``device_types``), else None. ``failing``: this rank joins only to report a failure
    (on the CPU, its device said as ``FAILING``)."""
    global _control
    kwargs: dict = {} if timeout is None else {"timeout": timeout}
    kinds = None
    if not dist.is_initialized():
        joined = device_types(FAILING if failing else device.type,
                              timeout or timedelta(minutes=10))
        kinds = joined[0] if joined else None
        on_gpus = set(kinds or [device.type]) == {"cuda"}
        _join("nccl" if on_gpus else "gloo", device, kwargs, joined[1] if joined else None)
    elif device.type == "cuda":         # a job joined by the caller: megatron-core allocates
        torch.cuda.set_device(device)   # on the current device
    if _control is None:
        _control = dist.new_group(backend="gloo", **kwargs)
    if timeout is not None:
        _later_groups_time_out(timeout)
    return kinds


_later_timeout: list[timedelta] = []       # the timeout groups made without one get


def _later_groups_time_out(timeout: timedelta) -> None:
    """Groups made from now on without a timeout (megatron-core's bridge groups) time out
    after ``timeout``, as the run's own do. torch has no setting for it: its group makers
    are wrapped once."""
    if not _later_timeout:
        for name in ("new_group", "new_subgroups_by_enumeration"):
            make = getattr(dist, name)

            def with_timeout(*args, _make=make, **kwargs):
                if kwargs.get("timeout") is None:
                    kwargs["timeout"] = _later_timeout[0]
                return _make(*args, **kwargs)
            setattr(dist, name, functools.wraps(make)(with_timeout))
    _later_timeout[:] = [timeout]


def device_types(kind: str, timeout: timedelta) -> tuple[list[str], dist.Store] | None:
    """Every rank's ``kind`` (its device type, ``cuda`` or ``cpu``, or ``FAILING``) in rank
    order, through torchrun's agent store before any process group exists (no collective),
    and that store under this round's own name, which the process groups are made in; None
    outside a torchrun job of several ranks, or under a launcher without an agent store
    (whose store rank 0's process group makes). The last rank to read them deletes them: an
    elastic job's next round (a node replaced) restarts the ranks with the same keys."""
    global _joins
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    _joins += 1
    store, attempt = _agent_store(timeout)
    world = int(os.environ["WORLD_SIZE"])
    keys = [_DEVICE_KEY.format(attempt=attempt, join=_joins, rank=rank)
            for rank in range(world)]
    rank = int(os.environ["RANK"])
    # rank 0 draws the round's name, which its process groups' keys are kept under (a round
    # restarted by torchrun, or by a node joining an elastic job, finds the keys of the one
    # before in the store, which outlives both; a node joining keeps the restart count)
    store.set(keys[rank], f"{kind} {uuid.uuid4().hex}" if rank == 0 else kind)
    try:
        store.wait(keys)
    except dist.DistStoreError:      # the store's timeout: the run's collective timeout
        missing = [each for each, key in enumerate(keys) if not store.check([key])]
        raise StartupError(
            f"rank(s) {missing} never joined the job within train.collective_timeout_minutes "
            f"({timeout.total_seconds() / 60:g}): their mimo_train stopped before it joined (a "
            "usage error, an import error: read their node's log) or never started", "device"
            ) from None
    values = [value.decode() for value in store.multi_get(keys)]
    read = _DEVICE_KEY.format(attempt=attempt, join=_joins, rank="read")
    if store.add(read, 1) == world:
        for key in [*keys, read]:
            store.delete_key(key)
    return [value.partition(" ")[0] for value in values], \
        dist.PrefixStore(f"mimo_train/{values[0].split()[1]}", store)


def _agent_store(timeout: timedelta) -> tuple[dist.TCPStore, str]:
    """A client of torchrun's store (``MASTER_ADDR``/``MASTER_PORT``), which outlives every
    rank, and this attempt's number (``--max-restarts`` starts a new one in the same store)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return store, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _join(backend: str, device: torch.device, kwargs: dict, store: dist.Store | None) -> None:
    """Make the default process group: in this round's ``store`` (``device_types``) where
    torchrun's agent keeps one, from the environment under another launcher, else alone."""
    if backend == "nccl":
        # With NCCL, binding the group to this rank's GPU tells barrier() (checkpoint saves)
        # which device to use instead of guessing (torch warns at every barrier otherwise).
        torch.cuda.set_device(device)
        kwargs = {**kwargs, "device_id": device}
    if store is not None:
        # torchrun's store outlives a round: a restart (--max-restarts) found the ranks'
        # addresses of the round before, and a rank connecting to a dead one failed it (torch
        # prefixes no round's keys): each round its own
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), **kwargs)
        return
    if "RANK" in os.environ:
        try:
            dist.init_process_group(backend, **kwargs)
        except (dist.DistStoreError, dist.DistNetworkError) as error:
            # a launcher's environment alone (srun): its address or its peers at fault
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise StartupError(
                f"rank {os.environ['RANK']} of WORLD_SIZE {os.environ.get('WORLD_SIZE')} could "
                f"not join the job at MASTER_ADDR:MASTER_PORT {where} "
                f"({str(error).splitlines()[0]}): check that every rank was started with the "
                "same address, that rank 0 runs there and the port is free (not another "
                "job's), and that the others started too", "device") from None
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, **kwargs)


def control() -> dist.ProcessGroup | None:
    """The control group (None before ``init``)."""
    return _control


def together() -> bool:
    """Whether this process is one rank of a job of several (collectives have peers)."""
    return dist.is_initialized() and dist.get_world_size() > 1


def rank_and_size() -> tuple[int, int]:
    """(this rank, the world size); (0, 1) outside a process group."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def gather(value) -> list:
    """``value`` of every rank, in rank order, over the control group (collective; the
    default group before ``init``, e.g. a failure before the trainer starts)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=_control)
    return gathered


def broadcast(value, src: int = 0):
    """Rank ``src``'s ``value`` on every rank, over the control group (collective)."""
    holder = [value]
    dist.broadcast_object_list(holder, src=src, group=_control)
    return holder[0]


def barrier() -> None:
    """Wait for every rank, over the control group: an all-reduce of a host tensor, since
    torch's barrier on a group bound to a GPU (the control group takes the default group's
    device) makes a tensor on that GPU, which a rank in a CUDA error cannot."""
    maximum(0)


def maximum(value: int) -> int:
    """The largest ``value`` of any rank, over the control group (collective)."""
    largest = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=_control)
    return int(largest.item())


@contextmanager
def alone() -> Iterator[None]:
    """A one-process group for the duration, unless the process is in one already (megatron-core's
    checkpoint reading asks the process group even in a single process: mimo-export)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def destroy() -> None:
    """Leave the job: the control group and the default group."""
    global _control
    _control = None
    if dist.is_initialized():
        dist.destroy_process_group()


# torchrun's store key of the job's first failure, per attempt (``--max-restarts`` starts a new
# attempt in the same store)
_FAILURE_KEY = "mimo_train/failure/{attempt}"


def claim_failure(message: str, wait_s: float = 0.0) -> bool:
    """Record ``message`` as the job's failure in torchrun's store (a ``TCPStore`` that outlives
    every rank; no collective, so a rank that failed alone can call it): True when it is the
    first recorded, False when another rank's came first. ``wait_s``: wait that long for another
    rank's record first (a rank that only lost its peers gives the failing one time to record
    its cause). Always True outside a torchrun job of several ranks."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        return True
    try:
        store, attempt = _agent_store(timedelta(seconds=10))
        key = _FAILURE_KEY.format(attempt=attempt)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not store.check([key]):
            time.sleep(0.1)
        return store.compare_set(key, "", message) == message.encode()
    except (RuntimeError, OSError):       # the store is gone (the agent stopped): say it here
        return True
