"""One epoch (or its rest, from a saved state) of the loader on every rank of a real multi-process
job with gloo; run by tests/test_loader_dist.py and tests/test_video_training.py. Several cases
(argument lists separated by ``+``) run one after another in the same job.

Every rank builds its own loader and iterates; the ranks all_gather what they consumed; rank 0
checks, per module, that its DP parts tile each global micro-batch, that all modules got the
same ordered global micro-batches and that no sample repeats, then writes a JSON result: per
module and step the keys and a sha256 of every tensor concatenated over the step (comparable
across layouts), the problems found, and the state saved after ``--save-after-steps`` steps.
Exit code 0 only when no problem was found.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

from mimo_data.loading.layout import LANGUAGE, Layout
from mimo_data.loading.loader import DataSource, build_loader
from mimo_data.loading.token_table import Partition


def leaves(value, path: str = "") -> dict:
    if isinstance(value, torch.Tensor):
        return {path: value}
    if not isinstance(value, dict):
        return {}
    return {name: tensor for key in sorted(value)
            for name, tensor in leaves(value[key], f"{path}/{key}").items()}


def table_digest(table) -> str:
    """sha256 of a token table's columns as numpy arrays (comparable across processes)."""
    digest = hashlib.sha256()
    for array in (table.drop, table.tokens, table.trained,
                  *(a for pair in table.item_tokens.values() for a in pair)):
        digest.update(array.tobytes())
    digest.update(json.dumps([table.reasons, table.details.to_pylist()]).encode())
    return digest.hexdigest()


def gather(value) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def consume(args, rank: int, world: int) -> dict:
    layout = Layout.parse(args.layout)
    state = json.loads(open(args.state).read()) if args.state else None
    dataset, digest = args.dataset, None
    if args.cache_dir:      # every rank opens the data: token tables computed split over ranks
        dataset = DataSource(args.dataset, args.config, cache_dir=args.cache_dir,
                             partition=Partition(rank, world, gather, writes=rank == 0))
        digest = table_digest(dataset.tables[0])
    loader = build_loader(dataset, args.config, layout, rank, world, args.global_batch_size,
                          args.micro_batch_size, args.seed, num_workers=args.workers,
                          state=state, balance=args.balance, packing=args.packing)
    consumed, saved = [], None
    if loader is not None:
        for batch, meta in loader:
            consumed.append({"step": meta["step"], "micro_batch": meta["micro_batch"],
                             "keys": meta["keys"], "encoder_keys": meta.get("encoder_keys", {}),
                             "tensors": leaves(batch)})
            if meta["micro_batch"] == loader.micro_batches_per_step - 1 and \
                    meta["step"] + 1 == args.save_after_steps:
                saved = loader.state_dict()
        loader.close()
    return {"rank": rank, "consumed": consumed if loader is not None else None, "state": saved,
            "table_digest": digest}


def check(layout: Layout, entries: list[dict]) -> dict:
    problems = []
    loaded = [e for e in entries if e["consumed"] is not None]
    counts = {e["rank"]: len(e["consumed"]) for e in loaded}
    if len(set(counts.values())) != 1:
        problems.append(f"ranks consumed different numbers of micro-batches: {counts}")
    steps_of = [c["step"] for c in loaded[0]["consumed"]]
    # (module, dp rank) -> per micro-batch: its keys, and its tensors by path (the pipeline
    # stages of one DP rank hold different tensors of the same samples)
    keys: dict[tuple, list] = {}
    tensors: dict[tuple, list] = {}
    for entry in loaded:
        role = layout.role(entry["rank"])
        for part in role.modules:
            if part.tp_rank or part.cp_rank or (part.name != LANGUAGE and part.pp_rank):
                continue
            served = [m for m, n in role.media.items() if n == part.name]   # all its modalities
            own = [c["keys"] if role.text_module == part.name else c["encoder_keys"][served[0]]
                   for c in entry["consumed"]]
            if keys.setdefault((part.name, part.dp_rank), own) != own:
                problems.append(f"rank {entry['rank']}: {part.name} dp rank {part.dp_rank} "
                                "differs from another rank of that DP rank")
            slots = tensors.setdefault((part.name, part.dp_rank), [{} for _ in own])
            for slot, c in zip(slots, entry["consumed"]):
                slot.update({path: tensor for path, tensor in c["tensors"].items()
                             if any(path.startswith(f"/modality_inputs/{m}/") for m in served) or
                             (role.text_module == part.name and
                              not path.startswith("/modality_inputs/"))})
    modules = {}
    for name in sorted({name for name, _ in keys}):
        per_step: dict[int, dict] = defaultdict(lambda: {"keys": [], "tensors": defaultdict(list)})
        for index, step in enumerate(steps_of):     # micro-batches in order, then DP parts
            for r in range(layout.module(name).dp):
                per_step[step]["keys"] += keys[(name, r)][index]
                for path, tensor in tensors[(name, r)][index].items():
                    per_step[step]["tensors"][path].append(tensor)
        modules[name] = [{"step": step, "keys": value["keys"],
                          "digests": {path: hashlib.sha256(torch.cat(
                              [part.reshape(-1) for part in parts]).numpy().tobytes()).hexdigest()
                                      for path, parts in sorted(value["tensors"].items())}}
                         for step, value in sorted(per_step.items())]
        served = [k for s in modules[name] for k in s["keys"]]
        if len(served) != len(set(served)):
            problems.append(f"module {name} got a sample twice")
    reference = [s["keys"] for s in modules.get(LANGUAGE, [])]
    for name, steps in modules.items():
        if [s["keys"] for s in steps] != reference:
            problems.append(f"module {name}'s global batches differ from {LANGUAGE}'s")
    return {"problems": problems, "modules": modules}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--layout", required=True)
    parser.add_argument("--global-batch-size", type=int, required=True)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--state", help="resume from this loader state (JSON)")
    parser.add_argument("--save-after-steps", type=int, default=0)
    parser.add_argument("--balance", default="none", choices=("none", "tokens"))
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--cache-dir", help="compute the token table split over the ranks, "
                        "into this cache directory")
    parser.add_argument("--out", required=True)
    return parser


def run_case(args, rank: int, world: int) -> int:
    """One case: every rank consumes, rank 0 checks and writes ``--out``; 1 if a problem."""
    entry = consume(args, rank, world)
    entries = [None] * world
    dist.all_gather_object(entries, entry)
    if rank != 0:
        return 0
    result = check(Layout.parse(args.layout), entries)
    states = [e["state"] for e in entries if e["consumed"] is not None]
    if args.save_after_steps and any(s != states[0] for s in states):
        result["problems"].append(f"ranks saved different states: {states}")
    result.update(world_size=world, layout=args.layout, state=states[0],
                  table_digests=[e["table_digest"] for e in entries])
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)
    return 1 if result["problems"] else 0


def main(argv: list[str]) -> int:
    """Each case of ``argv`` (cases separated by ``+``) in turn, in one process group."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cases: list[list[str]] = [[]]
    for arg in argv:
        if arg == "+":
            cases.append([])
        else:
            cases[-1].append(arg)
    code = 0
    for case in cases:
        code |= run_case(_parser().parse_args(case), rank, world)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
