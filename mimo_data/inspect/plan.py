"""``mimo-inspect plan``: what every rank gets per step for a layout, from the loader's dry run.

The layout is validated first (``Layout.validate``, the check the loader and trainer run).
Then ``dry_run.dry_run`` runs every rank's real loader in metadata-only mode; from its
micro-batches this module derives, per rank and module, samples and tokens per step (language
modules: sequence tokens and trained tokens; encoders: their modality's placeholder tokens,
i.e. what the encoder emits; a rank's are its DP rank's, and under context parallelism each CP
rank holds a contiguous 1/cp of every sequence, which the text says beside its rank's cp
coordinate), the imbalance between the DP ranks of each module (max / mean
tokens per step), steps per epoch and the remainder. ``--json`` prints the dry run itself (per
rank, per step, per micro-batch sample keys and token counts; with ``--packing``, language
ranks' ``sequences``) with this summary under ``"plan"``, its steps written through a
temporary file as they come. Nothing is kept per sample or per micro-batch: ``PlanSummary``
sums the figures as the dry run's micro-batches come (``dry_run``'s ``visit``), so memory does
not grow with the dataset (tests/test_plan_scale.py).

Packing efficiency (``plan["packing"]``, with or without ``--packing``): the language module's
real tokens over the token positions of three layouts of the same samples, summed over every
language DP rank's part of every micro-batch of the planned steps:

- ``tokens``: the real tokens; ``seq_length``: the preprocessing config's; ``enabled``:
  ``--packing`` (``data.packing``);
- ``packed``: the ``sequences`` of ``seq_length`` that ``packing.pack_parts`` (the loader's
  packing) makes of each part, ``efficiency`` = tokens / (sequences x seq_length). Which
  samples a part holds does not depend on packing, so the figures are the same either way. A
  packed batch carries no padding (THD), so this says how full the sequences are, not how
  many positions are computed;
- ``padded``: one row of ``seq_length`` per sample (the loader's unpacked tensors),
  ``efficiency`` = tokens / (rows x seq_length);
- ``cut_to_longest``: each part cut to its longest sample rounded up to ``length_multiple``
  (at most ``seq_length``), what the trainer computes without packing; ``positions`` = the
  sum over parts of rows x that length, ``efficiency`` = tokens / positions.
"""

from __future__ import annotations

import json
import sys
import tempfile
from array import array
from collections.abc import Callable

import numpy as np
from tqdm import tqdm

from mimo_data.loading.dry_run import dry_runs
from mimo_data.loading.layout import LANGUAGE, Layout, LayoutError
from mimo_data.loading.loader import DataSource, variable_token_modalities
from mimo_data.loading.packing import pack_parts
from mimo_data.preprocess.collate import LENGTH_MULTIPLE
from mimo_data.preprocess.config import PreprocessConfig


_PACK_CHUNK = 4096     # language parts packed at a time (``pack_parts`` is row by row)


class _Steps:
    """One module part of a rank: samples, tokens and trained tokens per step (``array``)."""

    def __init__(self):
        self.step, self.samples, self.tokens, self.trained = (array("q") for _ in range(4))

    def add(self, step: int, samples: int, tokens: int, trained: int) -> None:
        if not self.step or self.step[-1] != step:
            for column, value in ((self.step, step), (self.samples, 0), (self.tokens, 0),
                                  (self.trained, 0)):
                column.append(value)
        self.samples[-1] += samples
        self.tokens[-1] += tokens
        self.trained[-1] += trained


class PlanSummary:
    """The plan's figures, made as the dry run's micro-batches come (``dry_run``'s ``visit``)
    and nothing of them kept: per rank and module part, per step samples, tokens and trained
    tokens (``array``, 32 bytes a step); the packing figures of the language DP ranks' parts,
    summed a chunk at a time. A colocated encoder whose slice differs from its rank's text
    slice (``encoder_keys``) counts its samples' tokens at the end, from a table of every
    sample's hash and media tokens (8 bytes + 8 a modality per sample, numpy), as the loader
    gives them only with the text micro-batch that holds the sample."""

    def __init__(self, layout: Layout, world_size: int, micro_batch_size: int,
                 seq_length: int, modalities: list[str]):
        self.layout = layout
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.parts: dict[tuple[int, int], _Steps] = {}
        roles = [layout.role(rank) for rank in range(world_size)]
        self.table = any(module != role.text_module for role in roles
                         for module in role.media.values())
        self.hashes = array("q")                    # sample key hash -> media tokens
        self.media = {modality: array("q") for modality in modalities}
        self.pending: dict[tuple[int, int], tuple[array, array]] = {}   # key hash, step slot
        self.chunk: list[list[int]] = []
        self.packing = {"tokens": 0, "sequences": 0, "rows": 0, "positions": 0}

    def __call__(self, entry: dict, mb: dict) -> None:
        role = entry["role"]
        counts = mb.get("token_counts", {})
        if self.table:
            for i, key in enumerate(mb["keys"]):
                self.hashes.append(hash(key))
                for modality, column in self.media.items():
                    column.append(sum(counts[modality][i]) if modality in counts else 0)
        for index, part in enumerate(role["modules"]):
            steps = self.parts.setdefault((entry["rank"], index), _Steps())
            if part["module"] == LANGUAGE:
                steps.add(mb["step"], len(mb["keys"]), sum(mb["tokens"]),
                          sum(mb["trained_tokens"]))
                if part["tp_rank"] == 0 and part["pp_rank"] == 0 and \
                        part.get("cp_rank", 0) == 0:
                    self.chunk.append(mb["tokens"])
                    if len(self.chunk) == _PACK_CHUNK:
                        self._pack()
                continue
            # every modality the module encodes (a Qwen tower's images and videos)
            medias = [m for m, module in role["media"].items() if module == part["module"]]
            keys = mb.get("encoder_keys", {}).get(medias[0] if medias else None, mb["keys"])
            if keys == mb["keys"]:
                tokens = sum(sum(map(sum, counts[m])) for m in medias if m in counts)
                steps.add(mb["step"], len(keys), tokens, 0)
                continue
            steps.add(mb["step"], len(keys), 0, 0)
            hashes, slots = self.pending.setdefault((entry["rank"], index),
                                                    (array("q"), array("q")))
            for key in keys:
                hashes.append(hash(key))
                slots.append(len(steps.step) - 1)

    def _pack(self) -> None:
        if not self.chunk:
            return
        lengths = np.array(self.chunk, dtype=np.int64).reshape(len(self.chunk),
                                                                self.micro_batch_size)
        self.chunk = []
        multiple = LENGTH_MULTIPLE
        longest = np.minimum(-(-lengths.max(axis=1) // multiple) * multiple, self.seq_length)
        self.packing["tokens"] += int(lengths.sum())
        self.packing["sequences"] += int(pack_parts(lengths, self.seq_length)[1].sum())
        self.packing["rows"] += lengths.size
        self.packing["positions"] += int(longest.sum()) * lengths.shape[1]

    def _resolve(self, modalities_of) -> None:
        """The pending encoder parts' tokens, looked up by key hash in the sample table."""
        hashes = np.frombuffer(self.hashes, dtype=np.int64) if self.hashes else \
            np.zeros(0, np.int64)
        order = np.argsort(hashes, kind="stable")
        for (rank, index), (keys, slots) in self.pending.items():
            columns = [self.media[m] for m in modalities_of(rank, index) if m in self.media]
            wanted = np.frombuffer(keys, dtype=np.int64)
            at = np.searchsorted(hashes, wanted, sorter=order)
            found = order[np.minimum(at, len(order) - 1)] if len(order) else at
            if len(wanted) and (not len(order) or (hashes[found] != wanted).any()):
                # a key the language parts never held: the plan's own bug, not the data's
                raise RuntimeError(f"rank {rank} module part {index}: a sample of its steps "
                                   "is not among the language ranks' samples")
            values = sum((np.asarray(column, dtype=np.int64)[found] for column in columns),
                         np.zeros(len(wanted), np.int64))
            tokens = np.zeros(len(self.parts[rank, index].step), np.int64)
            np.add.at(tokens, np.asarray(slots, dtype=np.int64), values)
            self.parts[rank, index].tokens = array("q", tokens.tolist())
        self.pending = {}

    def summary(self, result: dict, with_steps: bool) -> dict:
        """Per rank and module: samples/tokens per step (``steps``: each step's, when
        ``with_steps``); per module: DP imbalance."""
        ranks = {entry["rank"]: entry for entry in result["ranks"]}

        def modalities_of(rank: int, index: int) -> list[str]:
            role = ranks[rank]["role"]
            module = role["modules"][index]["module"]
            return [m for m, name in role["media"].items() if name == module]

        self._resolve(modalities_of)
        modules = self.layout.modules
        tp_sizes = {module.name: module.tp for module in modules}
        cp_sizes = {module.name: module.cp for module in modules}
        rows: list = []
        by_module: dict = {}
        epoch_tokens: dict[str, int] = {}           # module -> its tokens over the epoch
        for entry in result["ranks"]:
            if entry["steps"] is None:
                rows.append({"rank": entry["rank"], "module": None, "needs_data": False})
                continue
            for index, part in enumerate(entry["role"]["modules"]):
                steps = self.parts.get((entry["rank"], index), _Steps())
                epoch_tokens[part["module"]] = epoch_tokens.get(part["module"], 0) + sum(
                    steps.tokens)
                tokens = np.asarray(steps.tokens, dtype=np.int64)
                tokens = tokens if len(tokens) else np.zeros(1, np.int64)
                samples = np.asarray(steps.samples or [0], dtype=np.int64)
                trained = np.asarray(steps.trained or [0], dtype=np.int64)
                row = {
                    "rank": entry["rank"], "module": part["module"], "needs_data": True,
                    "dp_rank": part["dp_rank"], "dp_size": part["dp_size"],
                    "pp_rank": part["pp_rank"], "pp_size": part["pp_size"],
                    "cp_rank": part["cp_rank"], "cp_size": cp_sizes[part["module"]],
                    "tp_rank": part["tp_rank"], "tp_size": tp_sizes[part["module"]],
                    "samples_per_step": float(np.mean(samples)),
                    "tokens_per_step_mean": float(np.mean(tokens)),
                    "tokens_per_step_max": int(tokens.max()),
                    "trained_per_step_mean": float(np.mean(trained))}
                if with_steps:
                    row["steps"] = [{"step": s, "samples": n, "tokens": t, "trained": d}
                                    for s, n, t, d in zip(steps.step, steps.samples,
                                                          steps.tokens, steps.trained)]
                rows.append(row)
                if part["tp_rank"] == 0 and part["pp_rank"] == 0 and \
                        part.get("cp_rank", 0) == 0:
                    by_module.setdefault(part["module"], {})[part["dp_rank"]] = tokens
        imbalance = {}
        for module, dp in by_module.items():
            per_step = np.array([dp[r] for r in sorted(dp)], dtype=np.float64)   # [dp, steps]
            means = per_step.mean(axis=0)
            ratios = np.divide(per_step.max(axis=0), means, out=np.ones_like(means),
                               where=means > 0)
            worst = int(ratios.argmax()) if len(ratios) else 0
            imbalance[module] = {"dp_size": len(dp), "mean": float(ratios.mean())
                                 if len(ratios) else 1.0, "max": float(ratios.max())
                                 if len(ratios) else 1.0, "worst_step": worst}
        idle = {module: {"modalities": sorted({m for entry in result["ranks"] for m, name in
                                               entry["role"]["media"].items() if name == module}),
                         "ranks": sorted({row["rank"] for row in rows
                                          if row["module"] == module})}
                for module, held in epoch_tokens.items() if not held and module != LANGUAGE}
        return {"ranks": rows, "imbalance": imbalance, "idle": idle}

    def packing_summary(self, enabled: bool) -> dict:
        """Language tokens over the positions of the packed, padded and cut-to-longest layouts
        of the planned micro-batches (the module docstring names the fields)."""
        self._pack()
        seq_length, figures = self.seq_length, self.packing
        tokens, sequences = figures["tokens"], figures["sequences"]
        rows, positions = figures["rows"], figures["positions"]
        return {"enabled": enabled, "seq_length": seq_length, "tokens": tokens,
                "packed": {"sequences": sequences,
                           "efficiency": tokens / (sequences * seq_length)},
                "padded": {"rows": rows, "efficiency": tokens / (rows * seq_length)},
                "cut_to_longest": {"length_multiple": LENGTH_MULTIPLE, "positions": positions,
                                   "efficiency": tokens / positions}}


def format_plan(result: dict, plan: dict) -> str:
    samples = result["samples"]
    reasons = ", ".join(f"{r} {e['count']}" for r, e in samples["skipped_by_reason"].items())
    lines = [
        f"layout    {result['layout']} ({'colocated' if result['colocated'] else 'non-colocated'}"
        f", {result['world_size']} ranks): valid",
        f"epoch     {result['epoch']}: {result['steps_per_epoch']} steps x "
        f"{result['micro_batches_per_step']} global micro-batches of "
        f"{result['global_micro_batch_size']} samples (global batch "
        f"{result['global_batch_size']}, micro batch {result['micro_batch_size']}, seed "
        f"{result['seed']})",
        f"samples   {samples['samples']}, {samples['kept']} kept, {samples['dropped']} dropped"
        + (f" ({reasons})" if reasons else "") + f"; remainder {result['remainder']}: "
        f"{result['remainder_samples']} samples not in this epoch",
        f"{'rank':>4s}  {'module':10s} {'dp':>5s} {'pp':>5s} {'cp':>5s} {'tp':>5s}  "
        f"{'samples/step':>12s}"
        f"  {'tokens/step mean':>16s} {'max':>7s}  {'trained/step':>12s}",
    ]
    for row in plan["ranks"]:
        if not row["needs_data"]:
            lines.append(f"{row['rank']:4d}  (no data: no loader on this rank)")
            continue
        trained = (f"{row['trained_per_step_mean']:12.1f}" if row["module"] == LANGUAGE
                   else f"{'-':>12s}")
        unit = "" if row["module"] == LANGUAGE else " (encoder)"
        cp = row["cp_size"]
        if cp > 1:              # its DP rank's tokens; it holds a contiguous 1/cp of each row
            unit += (f" (holds 1/{cp} of each sequence: ~"
                     f"{row['tokens_per_step_mean'] / cp:.1f} tokens/step; the row's figures "
                     "are its DP rank's, once for its cp ranks)")
        lines.append(f"{row['rank']:4d}  {row['module']:10s} "
                     f"{row['dp_rank']:>2d}/{row['dp_size']:<2d} {row['pp_rank']:>2d}/"
                     f"{row['pp_size']:<2d} {row['cp_rank']:>2d}/{cp:<2d} "
                     f"{row['tp_rank']:>2d}/{row['tp_size']:<2d}  "
                     f"{row['samples_per_step']:12.1f}"
                     f"  {row['tokens_per_step_mean']:16.1f} {row['tokens_per_step_max']:7d}  "
                     f"{trained}{unit}")
    lines.append("imbalance (max/mean tokens per step over a module's DP ranks), this plan's "
                 f"balance {plan.get('balance', 'none')} first")
    by_balance = plan.get("imbalance_by_balance", {"none": plan["imbalance"]})
    for balance in sorted(by_balance, key=lambda b: b != plan.get("balance", "none")):
        for module, data in by_balance[balance].items():
            lines.append(f"  balance {balance:6s} {module:10s} dp {data['dp_size']}: mean "
                         f"{data['mean']:.2f}, worst {data['max']:.2f} (step "
                         f"{data['worst_step']})")
    packing = plan["packing"]
    this_plan = "packed" if packing["enabled"] else "cut_to_longest"
    lines.append(f"packing   language real tokens / token positions computed ({packing['tokens']} "
                 f"tokens, seq_length {packing['seq_length']}), this plan's {this_plan} first")
    # packed: no padding is computed (THD); how full its sequences are is said beside
    layouts = {"packed": f"only the {packing['tokens']} real tokens are computed (--packing: no "
               f"padding), in {packing['packed']['sequences']} sequences of seq_length, "
               f"{packing['packed']['efficiency']:.2f} full",
               "cut_to_longest": f"{packing['cut_to_longest']['positions']} positions, each "
               "micro-batch cut to its longest sample rounded up to "
               f"{packing['cut_to_longest']['length_multiple']} (the trainer, unpacked)",
               "padded": f"{packing['padded']['rows']} rows of seq_length (the loader's unpacked "
               "tensors)"}
    for name in sorted(layouts, key=lambda n: n != this_plan):
        computed = 1.0 if name == "packed" else packing[name]["efficiency"]
        lines.append(f"  {name:14s} {computed:.2f}: {layouts[name]}")
    checks = result["checks"]
    lines.append("checks    " + ("ok: every rank has the same number of micro-batches and every "
                                 "module's DP parts concatenate to the same global micro-batch"
                                 if checks["ok"] else "FAILED: " + "; ".join(checks["problems"])))
    lines += [f"idle      {text}" for text in idle_modules(plan)]
    return "\n".join(lines)


def idle_modules(plan: dict) -> list[str]:
    """Per encoder module of ``plan`` that no sample of the epoch feeds, what that costs."""
    return [f"module {module!r} gets no item this epoch (the data holds no "
            f"{' or '.join(idle['modalities']) or 'item of it'}): its weights would not train "
            f"and its rank(s) {', '.join(map(str, idle['ranks']))} do nothing for it; drop it "
            "from the layout, or give the data it is for"
            for module, idle in plan.get("idle", {}).items()]


class _JsonSteps:
    """``dry_run``'s ``visit`` for ``--json``: every rank's steps written, as ``json.dumps``
    with ``indent=1`` writes them in the whole result, to a temporary file as they come (each
    rank's current step held until it ends; the ranks' steps interleave in the file, each
    step's place kept, 16 bytes); ``write`` prints the result around them, rank by rank."""

    def __init__(self):
        self.file = tempfile.TemporaryFile()
        self.spans: dict[int, tuple[array, array]] = {}   # rank -> its steps' starts, ends
        self.steps: dict[int, dict] = {}                  # rank -> the step being made

    def __call__(self, entry: dict, mb: dict) -> None:
        rank = entry["rank"]
        if mb["micro_batch"] == 0 or rank not in self.steps:
            self._flush(rank)
            self.steps[rank] = {"step": mb["step"], "micro_batches": []}
        self.steps[rank]["micro_batches"].append({k: v for k, v in mb.items() if k != "step"})

    def _flush(self, rank: int) -> None:
        step = self.steps.pop(rank, None)
        if step is None:
            return
        starts, ends = self.spans.setdefault(rank, (array("q"), array("q")))
        text = _INDENT * 4 + json.dumps(step, indent=1).replace("\n", "\n" + _INDENT * 4)
        starts.append(self.file.tell())
        self.file.write(((",\n" if len(ends) else "") + text).encode())
        ends.append(self.file.tell())

    def write(self, result: dict, plan: dict, out) -> None:
        for rank in list(self.steps):
            self._flush(rank)
        head, tail = json.dumps({**result, "ranks": _HOLE, "plan": plan},
                                indent=1).split(json.dumps(_HOLE))
        out.write(head + ("[\n" if result["ranks"] else "[]"))
        for number, entry in enumerate(result["ranks"]):
            before, after = (_INDENT * 2 + json.dumps({**entry, "steps": _HOLE}, indent=1)
                             .replace("\n", "\n" + _INDENT * 2)).split(json.dumps(_HOLE))
            out.write(("" if number == 0 else ",\n") + before)
            spans = self.spans.get(entry["rank"])
            if entry["steps"] is None:
                out.write("null")
            elif spans is None:
                out.write("[]")
            else:
                out.write("[\n")
                for start, end in zip(*spans):
                    self.file.seek(start)
                    left = end - start
                    while left:
                        chunk = self.file.read(min(left, 1 << 20))
                        out.write(chunk.decode())
                        left -= len(chunk)
                out.write("\n" + _INDENT * 3 + "]")
            out.write(after)
        out.write(("\n" + _INDENT + "]" if result["ranks"] else "") + tail + "\n")
        self.file.close()


_INDENT = " "
_HOLE = "\x00mimo-inspect plan: here\x00"


def make_plan(source: DataSource, config: PreprocessConfig, layout: Layout, args,
              visit: Callable[[dict, dict], object] | None = None) -> tuple[dict, dict]:
    """The dry run of ``args.balance`` (its micro-batches also go to ``visit``) and the plan:
    the other balance's dry run, made beside it, gives its imbalance. Each dry run streams its
    micro-batches into a ``PlanSummary``: nothing is kept per sample or per micro-batch."""
    summaries = {balance: PlanSummary(layout, layout.world_size, args.micro_batch_size,
                                      config.seq_length, list(config.modalities))
                 for balance in ("none", "tokens")}
    # the loader's own pass, every rank's micro-batches for both balances in turn: a while
    # for a large dataset (each sample's text is tokenized once)
    bar = tqdm(desc="mimo-inspect plan", unit=" micro-batches", file=sys.stderr, delay=1.0,
               disable=getattr(args, "no_progress", True))

    def each(balance: str, entry: dict, mb: dict) -> None:
        summaries[balance](entry, mb)
        if visit is not None and balance == args.balance:
            visit(entry, mb)
        bar.update()
    with bar:
        runs = dry_runs(source, config, layout, args.global_batch_size, args.micro_batch_size,
                        seed=args.seed, epoch=args.epoch, balances=tuple(summaries),
                        packing=args.packing, visit=each)
    result = runs[args.balance]
    plan = summaries[args.balance].summary(result, with_steps=args.json)
    plan["balance"] = args.balance
    plan["imbalance_by_balance"] = {
        balance: (plan["imbalance"] if balance == args.balance else
                  summaries[balance].summary(runs[balance], with_steps=False)["imbalance"])
        for balance in ("none", "tokens")}
    plan["packing"] = summaries[args.balance].packing_summary(args.packing)
    return result, plan


def run_plan(args, config: PreprocessConfig) -> int:
    """The ``plan`` subcommand: 0 valid and consistent, 1 failed checks, 2 a layout that
    cannot work (a config error, as ``mimo-train`` exits for it)."""
    layout = Layout.parse(args.layout)
    try:
        layout.validate(layout.world_size, args.global_batch_size, args.micro_batch_size,
                        variable_token_modalities(config), modalities=list(config.modalities))
    except LayoutError as exc:
        if args.json:
            print(json.dumps({"layout": str(layout), "valid": False, "problem": str(exc)},
                             indent=1))
        else:
            print(f"layout    {layout}: INVALID", file=sys.stdout)
        print(f"mimo-inspect plan: FAIL layout: {exc}", file=sys.stderr)
        return 2
    source = DataSource([args.directory], config, cache_dir=args.cache_dir,
                        progress=not args.no_progress)
    steps = _JsonSteps() if args.json else None
    result, plan = make_plan(source, config, layout, args, steps)
    if steps is not None:
        steps.write(result, plan, sys.stdout)
    else:
        print(format_plan(result, plan))
    for text in idle_modules(plan):
        print(f"mimo-inspect plan: WARNING {text}", file=sys.stderr)
    if not result["checks"]["ok"]:
        for problem in result["checks"]["problems"]:
            print(f"mimo-inspect plan: FAIL {problem}", file=sys.stderr)
        return 1
    return 0
