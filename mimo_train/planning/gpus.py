"""The GPUs the layout advisor plans on (``mimo-inspect plan --gpu``): each kind's memory,
peak's name and links (``GPUS``), and one resolved GPU of a plan (``GPU``). Read by the
advisor and by the trainer's out-of-memory advice, which names the kind to plan on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    tflops: float               # dense peak at the run's precision
    node_gbs: float             # collective bus bandwidth inside a node (NVLink), GB/s
    network_gbs: float          # across nodes, per GPU, GB/s
    per_node: int = 8


class GPUKind(NamedTuple):
    """One ``--gpu`` kind: its name, memory as the driver reports it, the name its peak
    FLOP/s go by (``flops.peak_tflops``) and its NCCL bus bandwidths in GB/s."""
    name: str
    memory_gib: float
    peak: str
    node_gbs: float
    network_gbs: float


# bandwidths: NCCL bus bandwidths of an 8-GPU NVLink node and a 400 Gb/s (H100, H200) or
# 200 Gb/s (A100) NIC per GPU, rounded down
GPUS = {"h100": GPUKind("H100 80GB", 79.6, "H100", 300.0, 40.0),
        "h200": GPUKind("H200 141GB", 140.4, "H200", 300.0, 40.0),
        "a100": GPUKind("A100 80GB", 80.0, "A100", 200.0, 20.0)}
