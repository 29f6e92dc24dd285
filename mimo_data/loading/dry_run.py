"""Dry run of the loader: every rank's micro-batches (sample keys, token counts) for a layout,
from the real loader code in metadata-only mode (no media decoded), plus the cross-module checks
the bridge depends on. Used by tests and by ``mimo-inspect plan``.

    python -m mimo_data.loading.dry_run shards/ --config configs/preprocess.yaml \\
        --layout 'language=dp2;image=dp1;audio=dp1' --global-batch-size 8 --micro-batch-size 2 \\
        [--steps 2] [--json]
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Callable

import numpy as np

from mimo_data.arguments import RUN_SEED, SEED, Parser, user_path
from mimo_data.shards.index import DatasetError
from mimo_data.loading.balance import BALANCE
from mimo_data.loading.layout import LANGUAGE, Layout, LayoutError
from mimo_data.loading.loader import TEXT_AHEAD, DataSource, build_loader, check_even_split

# The dry run's shared samples (texts and metadata tensors: ~120 bytes a token with
# multimodal rotary positions, measured) are bounded to 2**24 tokens' worth, ~2 GB at most
# (samples of seq_length), and at least SHARED_MIN samples.
SHARED_TOKENS = 1 << 24
SHARED_MIN = 1024
_MICRO_BATCH_FIELDS = ("keys", "tokens", "trained_tokens", "token_counts", "token_grids",
                       "encoder_keys", "sequences")


def dry_run(datasets, preprocess_config, layout, global_batch_size: int,
            micro_batch_size: int, *, world_size: int | None = None, seed: int = RUN_SEED,
            epoch: int = 0, steps: int | None = None, remainder: str = "drop",
            weights=None, num_workers: int = 0, balance: str = "none",
            packing: bool = False,
            visit: Callable[[dict, dict], object] | None = None) -> dict:
    """Per rank and step, the keys and token counts each micro-batch holds (JSON-ready); with
    ``packing``, language ranks' micro-batches also hold ``sequences`` (samples per packed
    sequence).

    ``checks``: every rank has the same number of micro-batches; for every module, the
    concatenation of its DP ranks' parts equals the language module's global micro-batch, and
    all ranks of one DP rank (tp, cp, pp) get the same samples.

    ``visit(entry, micro_batch)``: each micro-batch (its fields and ``step``) goes to it as the
    loaders make them and is not kept: every rank's ``steps`` stays an empty list (None: no
    loader), so memory does not grow with the dataset (``mimo-inspect plan``). The checks
    compare a 64-bit hash and a length per micro-batch, not the keys."""
    return dry_runs(datasets, preprocess_config, layout, global_batch_size, micro_batch_size,
                    world_size=world_size, seed=seed, epoch=epoch, steps=steps,
                    remainder=remainder, weights=weights, num_workers=num_workers,
                    balances=(balance,), packing=packing,
                    visit=None if visit is None else
                    lambda _, entry, mb: visit(entry, mb))[balance]


def dry_runs(datasets, preprocess_config, layout, global_batch_size: int,
             micro_batch_size: int, *, world_size: int | None = None, seed: int = RUN_SEED,
             epoch: int = 0, steps: int | None = None, remainder: str = "drop",
             weights=None, num_workers: int = 0, balances: tuple[str, ...] = ("none",),
             packing: bool = False,
             visit: Callable[[str, dict, dict], object] | None = None) -> dict[str, dict]:
    """``dry_run`` of each balance, its result by balance; ``visit(balance, entry,
    micro_batch)``.

    Every rank's loader of every balance steps in turn, a micro-batch at a time (each rank's
    micro-batches still come in order): the ranks that read a sample (a DP rank's TP and CP
    peers, its encoder ranks, each balance) read it within a few micro-batches of one another,
    so the data source keeps its record and text that long (``DataSource.share_texts``) and
    reads and tokenizes each sample once, not once a rank and balance."""
    layout = Layout.parse(layout)
    world_size = world_size or layout.world_size
    source = datasets if isinstance(datasets, DataSource) else \
        DataSource(datasets, preprocess_config, weights, num_workers)
    # the samples read between a sample's first reader and its last: a step's (balances
    # order them differently within it) and each stream's read ahead, over the slice of the
    # module with the most DP ranks; at most SHARED_TOKENS tokens' worth of samples of
    # seq_length (fewer kept: some samples read and tokenized again, the same plan)
    widest = max(module.dp for module in layout.modules)
    source.share_texts(min(2 * (global_batch_size + TEXT_AHEAD * widest),
                           max(SHARED_MIN, SHARED_TOKENS // source.config.seq_length)))
    try:
        results, streams = {}, []
        for balance in balances:
            ranks, plan = [], None
            seen = _Seen()
            for rank in range(world_size):
                loader = build_loader(source, None, layout, rank, world_size, global_batch_size,
                                      micro_batch_size, seed, remainder=remainder,
                                      decode_media=False, balance=balance, packing=packing)
                entry = {"rank": rank, "role": layout.role(rank).to_dict(), "steps": None}
                ranks.append(entry)
                if loader is None:
                    continue
                loader.load_state_dict({**loader.state_dict(), "epoch": epoch})
                plan = plan or {"steps_per_epoch": loader.steps_per_epoch,
                                "micro_batches_per_step": loader.micro_batches_per_step,
                                "global_micro_batch_size": loader.global_micro_batch_size,
                                **loader.report()}
                count = loader.micro_batches_per_epoch if steps is None else \
                    min(steps, loader.steps_per_epoch) * loader.micro_batches_per_step
                entry["steps"] = []
                streams.append((balance, entry, seen, loader, iter(zip(range(count), loader))))
            results[balance] = (ranks, plan, seen)
        while streams:
            going = []
            for stream in streams:
                balance, entry, seen, loader, micro_batches = stream
                taken = next(micro_batches, None)
                if taken is None:
                    loader.close()
                    continue
                going.append(stream)
                metadata = taken[1][1]
                mb = {"micro_batch": metadata["micro_batch"],
                      **{k: metadata[k] for k in _MICRO_BATCH_FIELDS if k in metadata}}
                seen.add(entry["rank"], mb)
                if visit is not None:
                    visit(balance, entry, {"step": metadata["step"], **mb})
                    continue
                if metadata["micro_batch"] == 0:
                    entry["steps"].append({"step": metadata["step"], "micro_batches": []})
                entry["steps"][-1]["micro_batches"].append(mb)
            streams = going
    finally:
        source.share_texts(0)
    return {balance: {"datasets": source.directories, "weights": source.weights,
                      "fingerprint": source.fingerprint, "layout": str(layout),
                      "colocated": layout.colocated, "world_size": world_size, "seed": seed,
                      "epoch": epoch, "global_batch_size": global_batch_size,
                      "micro_batch_size": micro_batch_size, "balance": balance,
                      "packing": packing, **(plan or {}), "ranks": ranks,
                      "checks": _checks(layout, ranks, source, seen)}
            for balance, (ranks, plan, seen) in results.items()}


_MASK = (1 << 64) - 1
_BASE = 0x100000001B3          # the polynomial hash's base (odd: invertible modulo 2**64)


def _hash(keys: list[str]) -> int:
    """A 64-bit polynomial hash of a list of keys: ``_combine`` gives a concatenation's."""
    value = 0
    for key in keys:
        value = (value * _BASE + hash(key)) & _MASK
    return value


class _Seen:
    """Per rank, per micro-batch: a hash and a length of its keys and of each modality's
    encoder keys (``array``: 16 bytes a micro-batch, no Python object)."""

    def __init__(self):
        self.keys: dict[tuple[int, str | None], tuple[array, array]] = {}

    def _append(self, rank: int, name: str | None, keys: list[str], value: int) -> None:
        hashes, lengths = self.keys.setdefault((rank, name), (array("Q"), array("q")))
        hashes.append(value)
        lengths.append(len(keys))

    def add(self, rank: int, mb: dict) -> None:
        value = _hash(mb["keys"])
        self._append(rank, None, mb["keys"], value)
        for modality, keys in mb.get("encoder_keys", {}).items():
            self._append(rank, modality, keys, value if keys == mb["keys"] else _hash(keys))

    def of(self, rank: int, modality: str | None) -> tuple[np.ndarray, np.ndarray]:
        hashes, lengths = self.keys.get((rank, modality), (array("Q"), array("q")))
        return (np.frombuffer(hashes, dtype=np.uint64) if hashes else
                np.zeros(0, np.uint64), np.asarray(lengths, dtype=np.int64))


def _same(a: tuple[np.ndarray, np.ndarray] | None, b: tuple[np.ndarray, np.ndarray]) -> bool:
    return a is not None and all(np.array_equal(x, y) for x, y in zip(a, b))


def _combine(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Per micro-batch, the hash and length of the concatenation of ``parts`` (DP ranks in
    order), over as many micro-batches as every part has."""
    count = min(len(h) for h, _ in parts)
    value, total = np.zeros(count, np.uint64), np.zeros(count, np.int64)
    for hashes, lengths in parts:
        shift = np.power(np.uint64(_BASE), lengths[:count].astype(np.uint64))
        value = value * shift + hashes[:count]          # modulo 2**64, as ``_hash``
        total = total + lengths[:count]
    return value, total


def _checks(layout: Layout, ranks: list[dict], source: DataSource, seen: _Seen) -> dict:
    problems = []
    try:
        check_even_split(source, layout)
    except LayoutError as error:
        problems.append(str(error))
    loaded = [r for r in ranks if r["steps"] is not None]
    counts = {r["rank"]: len(seen.of(r["rank"], None)[0]) for r in loaded}
    if len(set(counts.values())) > 1:
        problems.append(f"micro-batches per rank differ: {counts}")
    by_module: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for entry in loaded:
        for part in entry["role"]["modules"]:
            if part["module"] != LANGUAGE and part["pp_rank"]:
                continue
            if part["module"] == LANGUAGE or entry["role"]["text_module"] == part["module"]:
                keys = seen.of(entry["rank"], None)
            else:   # a colocated encoder whose slice differs from the rank's text slice
                modality = next(m for m, n in entry["role"]["media"].items()
                                if n == part["module"])
                keys = seen.of(entry["rank"], modality)
            first = by_module.setdefault(part["module"], {}).setdefault(part["dp_rank"], keys)
            if not _same(first, keys):
                problems.append(f"rank {entry['rank']} ({part['module']} dp rank "
                                f"{part['dp_rank']}) gets other samples than its DP peers")
    if by_module:
        global_batches = {name: _combine([dp[r] for r in sorted(dp)])
                          for name, dp in by_module.items()}
        reference = global_batches.get(LANGUAGE)
        for name, batches in global_batches.items():
            if not _same(reference, batches):
                problems.append(f"module {name!r}'s global micro-batches differ from "
                                f"{LANGUAGE!r}'s")
    return {"ok": not problems, "problems": problems}


def format_dry_run(result: dict) -> str:
    """The dry run for people: the plan, each rank's role and micro-batches, the checks."""
    lines = [f"layout {result['layout']} ({'colocated' if result['colocated'] else 'non-colocated'}"
             f", {result['world_size']} ranks), global batch {result['global_batch_size']}, "
             f"micro batch {result['micro_batch_size']}, seed {result['seed']}, "
             f"epoch {result['epoch']}, balance {result['balance']}"
             f"{', packed' if result['packing'] else ''}"]
    if "steps_per_epoch" in result:
        samples = result["samples"]
        reasons = ", ".join(f"{reason} {entry['count']}"
                            for reason, entry in samples["skipped_by_reason"].items())
        lines.append(f"{result['steps_per_epoch']} steps/epoch x "
                     f"{result['micro_batches_per_step']} global micro-batches of "
                     f"{result['global_micro_batch_size']} samples; {samples['samples']} "
                     f"samples, {samples['kept']} kept, {samples['dropped']} dropped"
                     f"{f' ({reasons})' if reasons else ''}; remainder {result['remainder']}: "
                     f"{result['remainder_samples']} samples")
    for entry in result["ranks"]:
        role = entry["role"]
        parts = ", ".join(f"{m['module']} dp {m['dp_rank']}/{m['dp_size']} pp "
                          f"{m['pp_rank']}/{m['pp_size']} tp {m['tp_rank']}"
                          for m in role["modules"])
        if entry["steps"] is None:
            lines.append(f"rank {entry['rank']}: {parts}: no data")
            continue
        needs = ", ".join(role["text_keys"] + [f"{m} inputs" for m in role["media"]])
        lines.append(f"rank {entry['rank']}: {parts}: {needs}")
        for step in entry["steps"]:
            for mb in step["micro_batches"]:
                samples = " ".join(f"{key}({tokens})" for key, tokens in
                                   zip(mb["keys"], mb["tokens"]))
                if "sequences" in mb:           # packed: samples per sequence
                    samples += f" | sequences of {mb['sequences']} samples"
                others = "".join(f" | {modality} inputs: {' '.join(keys)}" for modality, keys
                                 in mb.get("encoder_keys", {}).items() if keys != mb["keys"])
                lines.append(f"  step {step['step']} mb {mb['micro_batch']}: {samples}{others}")
    checks = result["checks"]
    lines.append("checks: ok" if checks["ok"] else
                 "checks FAILED:\n" + "\n".join(f"  {p}" for p in checks["problems"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m mimo_data.loading.dry_run",
                    description=__doc__.split("\n\n")[0])
    parser.add_argument("datasets", nargs="+", type=user_path,
                        help="dataset directories (mimo-shard build)")
    parser.add_argument("--config", required=True, type=user_path,
                        help="preprocessing config (YAML)")
    parser.add_argument("--layout", required=True, type=user_path,
                        help="'language=dp2;image=dp1' or a layout YAML file")
    parser.add_argument("--global-batch-size", type=int, required=True)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--world-size", type=int, help="default: the layout's ranks")
    parser.add_argument("--weights", type=float, nargs="+", help="blend weights, one a dataset")
    parser.add_argument("--seed", type=SEED, default=RUN_SEED,
                        help=f"sample-order seed (default {RUN_SEED}, train.seed's)")
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--steps", type=int, help="first N steps only (default: the epoch)")
    parser.add_argument("--remainder", choices=("drop", "wrap"), default="drop")
    parser.add_argument("--balance", choices=BALANCE, default="none",
                        help="data.balance: tokens orders each step's samples as the run does")
    parser.add_argument("--packing", action="store_true",
                        help="data.packing: the language ranks' samples packed into sequences")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    try:
        result = dry_run(args.datasets, args.config, args.layout, args.global_batch_size,
                         args.micro_batch_size, world_size=args.world_size, seed=args.seed,
                         epoch=args.epoch, steps=args.steps, remainder=args.remainder,
                         weights=args.weights, balance=args.balance, packing=args.packing)
    except (ValueError, RuntimeError, OSError, DatasetError) as exc:
        print(f"dry run: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else format_dry_run(result))
    return 0 if result["checks"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
