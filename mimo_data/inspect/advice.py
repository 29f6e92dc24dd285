"""What ``mimo-inspect plan --model M --gpus N`` asks the layout advisor: the request the command
builds from its own options (``cli``), which mimo_train's advisor (``mimo_train.planning.
advisor``) answers with the dataset's per-step work beside it (``workload``). mimo_data never
imports mimo_train: the advisor is handed in by ``mimo_train.inspect_cli``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdvisorRequest:
    """The advisor's question: a model on ``gpus`` GPUs of a kind, and which candidates to
    try and show."""
    model: str                            # a training config YAML, a checkpoint or its config
    config: str                           # the preprocessing config's path
    gpus: int
    gpu: str = "h100"                     # h100 | h200 | a100
    gpu_memory_gib: float | None = None   # None: the kind's
    gpu_tflops: float | None = None       # None: the kind's peak at the precision
    gpus_per_node: int = 8
    mfu: float | None = None              # None: the advisor's default
    precision: str | None = None          # None: the training config's, else bf16
    distributed_optimizer: str = "both"   # both | yes | no
    recompute: str = "any"                # any | none | selective | full
    sequence_parallel: bool = True        # where the rules allow it
    top: int = 5                          # layouts shown with their reasons
    layout: str | None = None             # yours: ranked too, or said why not
    packing: bool = False                 # --packing (a training YAML's data.packing wins)
    json: bool = False
    fewer_gpus: bool = False              # also layouts on fewer than gpus (the rest idle)
    # data.split_media of the candidates: no (unless the training YAML sets it), yes (split
    # where the trainer's rules allow it, else whole samples), both (each: --clip-seconds)
    split_media: str = "no"
    progress: bool = False                # a bar on stderr while the candidates are evaluated

    @classmethod
    def from_args(cls, args) -> AdvisorRequest:
        """The request of ``plan``'s parsed options."""
        return cls(args.model, args.config, args.gpus, args.gpu, args.gpu_memory_gib,
                   args.gpu_tflops, args.gpus_per_node, args.mfu, args.precision,
                   args.distributed_optimizer, args.recompute, not args.no_sequence_parallel,
                   args.top, args.layout, args.packing, args.json,
                   args.fewer_gpus or args.clip_seconds is not None,
                   "yes" if args.split_media else
                   "both" if args.clip_seconds is not None else "no",
                   not args.no_progress)
