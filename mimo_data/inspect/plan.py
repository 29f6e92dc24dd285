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
ranks' ``sequences``) with this summary under ``"plan"``.

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

import numpy as np

from mimo_data.loading.dry_run import dry_run
from mimo_data.loading.layout import LANGUAGE, Layout, LayoutError
from mimo_data.loading.loader import DataSource, variable_token_modalities
from mimo_data.loading.packing import pack_parts
from mimo_data.preprocess.collate import LENGTH_MULTIPLE
from mimo_data.preprocess.config import PreprocessConfig


def _sample_table(result: dict) -> dict[str, dict]:
    """Sample id -> tokens, trained tokens and encoder tokens per modality, from the micro-
    batches that carry text tensors' metadata."""
    table = {}
    for entry in result["ranks"]:
        for step in entry["steps"] or []:
            for mb in step["micro_batches"]:
                counts = mb.get("token_counts", {})
                for i, key in enumerate(mb["keys"]):
                    table[key] = {"tokens": mb["tokens"][i],
                                  "trained": mb["trained_tokens"][i],
                                  **{m: sum(per_sample[i]) for m, per_sample in counts.items()}}
    return table


def _part_steps(entry: dict, part: dict, table: dict) -> list[dict]:
    """Samples and tokens per step of one module part of a rank."""
    modality = next((m for m, module in entry["role"]["media"].items()
                     if module == part["module"]), None)
    steps = []
    for step in entry["steps"]:
        samples = tokens = trained = 0
        for mb in step["micro_batches"]:
            if part["module"] == LANGUAGE:
                keys = mb["keys"]
                tokens += sum(table[k]["tokens"] for k in keys)
                trained += sum(table[k]["trained"] for k in keys)
            else:
                keys = mb.get("encoder_keys", {}).get(modality, mb["keys"])
                tokens += sum(table[k].get(modality, 0) for k in keys)
            samples += len(keys)
        steps.append({"step": step["step"], "samples": samples, "tokens": tokens,
                      "trained": trained})
    return steps


def plan_summary(result: dict) -> dict:
    """Per rank and module: samples/tokens per step; per module: DP imbalance."""
    table = _sample_table(result)
    modules = Layout.parse(result["layout"]).modules
    tp_sizes = {module.name: module.tp for module in modules}
    cp_sizes = {module.name: module.cp for module in modules}
    rows: list = []
    by_module: dict = {}
    for entry in result["ranks"]:
        if entry["steps"] is None:
            rows.append({"rank": entry["rank"], "module": None, "needs_data": False})
            continue
        for part in entry["role"]["modules"]:
            steps = _part_steps(entry, part, table)
            tokens = [s["tokens"] for s in steps] or [0]
            rows.append({
                "rank": entry["rank"], "module": part["module"], "needs_data": True,
                "dp_rank": part["dp_rank"], "dp_size": part["dp_size"],
                "pp_rank": part["pp_rank"], "pp_size": part["pp_size"],
                "cp_rank": part["cp_rank"], "cp_size": cp_sizes[part["module"]],
                "tp_rank": part["tp_rank"], "tp_size": tp_sizes[part["module"]],
                "samples_per_step": float(np.mean([s["samples"] for s in steps] or [0])),
                "tokens_per_step_mean": float(np.mean(tokens)),
                "tokens_per_step_max": int(max(tokens)),
                "trained_per_step_mean": float(np.mean([s["trained"] for s in steps] or [0])),
                "steps": steps})
            if part["tp_rank"] == 0 and part["pp_rank"] == 0 and part.get("cp_rank", 0) == 0:
                by_module.setdefault(part["module"], {})[part["dp_rank"]] = tokens
    imbalance = {}
    for module, dp in by_module.items():
        per_step = np.array([dp[r] for r in sorted(dp)], dtype=np.float64)   # [dp, steps]
        means = per_step.mean(axis=0)
        ratios = np.divide(per_step.max(axis=0), means, out=np.ones_like(means),
                           where=means > 0)
        worst = int(ratios.argmax()) if len(ratios) else 0
        imbalance[module] = {"dp_size": len(dp), "mean": float(ratios.mean()) if len(ratios)
                             else 1.0, "max": float(ratios.max()) if len(ratios) else 1.0,
                             "worst_step": worst}
    return {"ranks": rows, "imbalance": imbalance}


def _language_parts(result: dict) -> np.ndarray:
    """Token counts ``[parts, micro_batch_size]``: each language DP rank's part of each planned
    micro-batch (one rank per DP rank)."""
    parts: list[list[int]] = []
    for entry in result["ranks"]:
        for part in entry["role"]["modules"]:
            first_of_dp_rank = (part["tp_rank"] == 0 and part["pp_rank"] == 0
                                and part.get("cp_rank", 0) == 0)
            if part["module"] == LANGUAGE and first_of_dp_rank and entry["steps"] is not None:
                parts.extend(mb["tokens"] for step in entry["steps"]
                             for mb in step["micro_batches"])
    return np.array(parts, dtype=np.int64).reshape(len(parts), result["micro_batch_size"])


def packing_summary(result: dict, seq_length: int, enabled: bool) -> dict:
    """Language tokens over the positions of the packed, padded and cut-to-longest layouts of
    the planned micro-batches (the module docstring names the fields)."""
    lengths = _language_parts(result)
    tokens = int(lengths.sum())
    sequences = int(pack_parts(lengths, seq_length)[1].sum())
    rows = lengths.size
    multiple = LENGTH_MULTIPLE
    longest = np.minimum(-(-lengths.max(axis=1) // multiple) * multiple, seq_length)
    positions = int(longest.sum()) * lengths.shape[1]
    return {"enabled": enabled, "seq_length": seq_length, "tokens": tokens,
            "packed": {"sequences": sequences, "efficiency": tokens / (sequences * seq_length)},
            "padded": {"rows": rows, "efficiency": tokens / (rows * seq_length)},
            "cut_to_longest": {"length_multiple": multiple, "positions": positions,
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
                     f"{row['tokens_per_step_mean'] / cp:.1f} tokens/step)")
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
    lines.append(f"packing   language real tokens / token positions ({packing['tokens']} tokens, "
                 f"seq_length {packing['seq_length']}), this plan's {this_plan} first")
    layouts = {"packed": f"{packing['packed']['sequences']} sequences of seq_length (--packing; "
               f"only the {packing['tokens']} real tokens are computed)",
               "cut_to_longest": f"{packing['cut_to_longest']['positions']} positions, each "
               "micro-batch cut to its longest sample rounded up to "
               f"{packing['cut_to_longest']['length_multiple']} (the trainer, unpacked)",
               "padded": f"{packing['padded']['rows']} rows of seq_length (the loader's unpacked "
               "tensors)"}
    for name in sorted(layouts, key=lambda n: n != this_plan):
        lines.append(f"  {name:14s} {packing[name]['efficiency']:.2f}: {layouts[name]}")
    checks = result["checks"]
    lines.append("checks    " + ("ok: every rank has the same number of micro-batches and every "
                                 "module's DP parts concatenate to the same global micro-batch"
                                 if checks["ok"] else "FAILED: " + "; ".join(checks["problems"])))
    return "\n".join(lines)


def run_plan(args, config: PreprocessConfig) -> int:
    """The ``plan`` subcommand: 0 valid and consistent, 1 failed checks, 2 a layout that
    cannot work (a config error, as ``mimo-train`` exits for it)."""
    layout = Layout.parse(args.layout)
    try:
        layout.validate(layout.world_size, args.global_batch_size, args.micro_batch_size,
                        variable_token_modalities(config), modalities=list(config.modalities))
    except LayoutError as exc:
        print(f"layout    {layout}: INVALID", file=sys.stdout)
        print(f"mimo-inspect plan: FAIL layout: {exc}", file=sys.stderr)
        return 2
    source = DataSource([args.directory], config, cache_dir=args.cache_dir)
    runs = {balance: dry_run(source, config, layout, args.global_batch_size,
                             args.micro_batch_size, seed=args.seed, epoch=args.epoch,
                             balance=balance, packing=args.packing)
            for balance in ("none", "tokens")}
    result = runs[args.balance]
    plan = plan_summary(result)
    plan["balance"] = args.balance
    plan["imbalance_by_balance"] = {balance: plan_summary(run)["imbalance"]
                                    for balance, run in runs.items()}
    plan["packing"] = packing_summary(result, config.seq_length, args.packing)
    if args.json:
        print(json.dumps({**result, "plan": plan}, indent=1))
    else:
        print(format_plan(result, plan))
    if not result["checks"]["ok"]:
        for problem in result["checks"]["problems"]:
            print(f"mimo-inspect plan: FAIL {problem}", file=sys.stderr)
        return 1
    return 0
