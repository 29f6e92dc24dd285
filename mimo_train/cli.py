"""``mimo-train`` / ``torchrun --nproc-per-node N -m mimo_train --config CFG [key=value ...]``."""

from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

from mimo_train.config import TrainConfig, TrainConfigError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="mimo-train", description="Train a MIMO model (megatron-core MimoModel) on shards "
        "from mimo-shard build; run one process per rank under torchrun.")
    parser.add_argument("--config", required=True, help="training config YAML")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="config overrides, e.g. train.steps=50 checkpoint.dir=runs/x")
    parser.add_argument("--records", help="write every logged record as JSON lines here "
                        "(rank 0)")
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig.load(args.config, args.overrides)
    except TrainConfigError as error:
        print(f"mimo-train: {error}", file=sys.stderr)
        return 2
    from mimo_train.trainer import StartupError, dump_records, train
    try:
        records = train(cfg)
        if args.records:
            dump_records(records, args.records)
    except (StartupError, TrainConfigError) as error:
        print(f"mimo-train: {error}", file=sys.stderr, flush=True)
        # Every rank gets here from the same agreement (trainer._agree). Exit only once all
        # have printed: torchrun stops the other ranks as soon as the first one exits.
        if dist.is_initialized():
            dist.barrier()
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
