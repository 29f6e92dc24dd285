"""``mimo-inspect checkpoint``: whether a run's checkpoints are intact, and what each holds,
without starting a run (before a resume; after copying a checkpoint to another cluster).

Each checkpoint's files are hashed against its manifest (``digests``) by a few threads in this
one process, the check a resume makes before it loads anything; its ``meta.json`` says the
step, the layout, the global batch size and the model it was saved with. What a resume makes
of a checkpoint.dir (the step ``latest`` names, its refusals, the earlier step it falls back
to) is ``checkpoint_folders``' rules, the trainer's own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field

from mimo_train.checkpoint_folders import (LATEST, MANIFEST, META, STEP_NAME, complete_steps,
                                           earlier_steps, is_step_folder, latest, meta_of,
                                           not_a_step, resume_point)
from mimo_data.stats import size_text
from mimo_train.components import checkpoint_owner, digests
from mimo_train.errors import CheckpointError, IntegrityError

@dataclass
class StepReport:
    """One checkpoint's verdict."""
    path: str
    complete: bool                   # its save finished: the manifest written
    problems: list[str] = field(default_factory=list)   # empty: every file matches
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0             # the hashing's
    meta: dict | None = None         # meta.json, where it reads
    leftover: bool = False           # unfinished, after the step a resume loads: ignored by a
    #                                  resume, replaced by its save of that step

    @property
    def intact(self) -> bool:
        return self.complete and not self.problems


@dataclass
class Findings:
    """What ``inspect_checkpoints`` found at the path it was given."""
    path: str
    steps: list[str]                 # a checkpoint.dir's step folders, oldest first
    reports: list[StepReport]        # each checked step, oldest first
    resumes: str | None = None       # the step folder a resume loads (``latest``)
    named: str | None = None         # the step folder ``latest`` names, there or not
    refusal: str = ""                # why a resume refuses the folder or finds nothing
    instead: str | None = None       # the newest intact step to resume from in its place
    writer: str | None = None        # the run that writes the checkpoint.dir now, described

    @property
    def intact(self) -> bool:
        """What a resume needs holds: no refusal, and every step checked intact but a
        save left unfinished after the step it loads (a run stopped while saving, or saving
        now: the normal state after a preemption)."""
        return not self.refusal and all(report.intact or report.leftover
                                        for report in self.reports)


def inspect_checkpoints(path: str, every: bool = False, workers: int = 4) -> Findings:
    """Check the checkpoint at ``path``: a step's folder, or a checkpoint.dir (the step its
    ``latest`` names; ``every``: each of its steps); where the step a resume loads is not
    intact, the earlier ones, newest first, until one is. CheckpointError where ``path``
    holds no checkpoint."""
    if os.path.isfile(path):
        raise CheckpointError(f"{path} is a file, not a folder: give a run's checkpoint.dir or "
                              "one of its step_NNNNNNN folders")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    try:
        names = os.listdir(path)
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read ({error.strerror})") from None
    steps = sorted(name for name in names if re.fullmatch(STEP_NAME, name)
                   and os.path.isdir(os.path.join(path, name)))
    if not steps:
        if not is_step_folder(path):
            not_a_step(path)                  # a transformers model folder is said as such
            raise CheckpointError(f"{path} holds no mimo checkpoint: give a run's "
                                  "checkpoint.dir or one of its step_NNNNNNN folders")
        report = check_step(path, workers)
        found = Findings(path, [], [report])
        if not report.intact:
            found.instead = _first_intact(found, earlier_steps(path), workers)
        return found
    found = Findings(path, steps, [], writer=checkpoint_owner.writer(path))
    try:
        found.resumes = resume_point(path)
    except CheckpointError as error:     # latest names no folder, or there is no latest
        found.refusal = str(error)
    try:
        named = found.named = latest(path)
    except CheckpointError:              # an empty or unreadable latest: refused above
        named = None
    if found.resumes is None and not found.refusal:
        found.refusal = (f"{path} holds no complete checkpoint (no step's integrity.json): a "
                         "resume starts the run over")
    chosen = [os.path.join(path, name) for name in steps] if every else \
        [found.resumes] if found.resumes else []
    found.reports = [check_step(step, workers) for step in chosen]
    for report in found.reports:
        # (step folders' names are of one width, STEP_NAME: they compare as their steps do)
        report.leftover = not report.complete and found.resumes is not None and \
            os.path.basename(report.path) > os.path.basename(found.resumes)
    resumed = next((r for r in found.reports if r.path == found.resumes), None)
    if resumed is None or not resumed.intact:
        fallback = earlier_steps(named) if named else \
            [os.path.join(path, name) for name in reversed(complete_steps(path))]
        found.instead = _first_intact(found, fallback, workers)
    return found


def _first_intact(found: Findings, candidates: list[str], workers: int) -> str | None:
    """The first of ``candidates`` (newest first) whose files are intact, checking those not
    checked yet (their reports added). Paths compare absolute: ``earlier_steps`` gives them
    so, a checkpoint.dir's own reports as the path was given."""
    checked = {os.path.abspath(report.path): report for report in found.reports}
    for candidate in candidates:
        report = checked.get(os.path.abspath(candidate))
        if report is None:
            report = check_step(candidate, workers)
            found.reports = sorted([*found.reports, report], key=lambda r: os.path.basename(
                os.path.normpath(r.path)))
        if report.intact:
            return candidate
    return None


def check_step(directory: str, workers: int = 4) -> StepReport:
    """One step folder's files against its manifest, and its meta.json."""
    report = StepReport(directory, os.path.isfile(os.path.join(directory, MANIFEST)))
    report.meta = meta_of(directory)
    if not report.complete:
        report.problems.append(f"no {MANIFEST}: its save did not finish (a run stopped or "
                               "failing while saving, or saving now); a resume cannot use it")
        return report
    meta_there = os.path.isfile(os.path.join(directory, META))
    unread = (f"{META} is unreadable (not a JSON object)" if meta_there else f"{META} is missing"
              ) if report.meta is None else None
    try:
        expected, sizes = digests.read_manifest(directory)
    except IntegrityError as error:
        report.problems += [*([unread] if unread else []), str(error)]
        return report
    if unread and (meta_there or META not in expected):    # else the files' check says it
        report.problems.append(unread)
    started = time.perf_counter()
    report.problems += digests.mismatches(directory, sorted(expected), expected, sizes, workers)
    report.seconds = time.perf_counter() - started
    report.files = len(expected)
    report.bytes = sum(os.path.getsize(os.path.join(directory, name)) for name in expected
                       if os.path.isfile(os.path.join(directory, name)))
    return report


def _summary(meta: dict) -> str:
    """The settings a resume must match and the model, from a checkpoint's meta.json."""
    config = meta.get("config") or {}
    model = config.get("model") or {}
    step, batch = meta.get("step"), meta.get("global_batch_size")
    of = (config.get("train") or {}).get("steps")
    seen = f", {step * batch:,} samples" if isinstance(step, int) and \
        isinstance(batch, int) else ""
    pretrained = model.get("pretrained") or (model.get("language") or {}).get("pretrained")
    parts = [f"step {step}" + (f" of {of}" if of else "") + seen,
             f"global batch {batch}", f"layout {meta.get('layout')}",
             f"world size {meta.get('world_size')}"]
    if pretrained:
        parts.append(f"model {pretrained}")
    if model.get("lora"):
        bases = [base for base in meta.get("lora_base") or () if isinstance(base, dict)]
        parts.append("LoRA" + "".join(
            f"{' over' if i == 0 else ','} {base.get('key')} {base.get('path')} (weights' "
            f"sha256 {str(base.get('sha256'))[:12]}…)" for i, base in enumerate(bases)))
        if bases:                        # what the adapters alone are exported onto
            parts.append("`mimo-export --adapters` needs that base unchanged")
    return "; ".join(parts)


def main(args: argparse.Namespace) -> int:
    """The subcommand (``args``: ``directory``, ``all``, ``workers``, ``json``): 0 when every
    checkpoint checked is intact (or a save left unfinished after it) and a resume would
    load the step ``latest`` names, 1 when one is damaged or unfinished or a resume refuses
    the folder, 2 when the path holds no
    checkpoint, 130 when interrupted. Every verdict on stdout, one ``FAIL`` line per problem
    on stderr."""
    try:
        found = inspect_checkpoints(args.directory, args.all, args.workers)
    except CheckpointError as error:
        print(f"mimo-inspect checkpoint: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mimo-inspect checkpoint: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps({"path": found.path, "steps": found.steps, "latest": found.resumes,
                          "refusal": found.refusal, "instead": found.instead,
                          "writer": found.writer,
                          "intact": found.intact, "checkpoints": [
                              {**asdict(report), "intact": report.intact}
                              for report in found.reports]}, indent=1))
    else:
        _print(found)
    for report in found.reports:
        for problem in [] if report.leftover else report.problems:
            print(f"mimo-inspect checkpoint: FAIL {_name(found, report)}: {problem}",
                  file=sys.stderr)
    if found.refusal:
        print(f"mimo-inspect checkpoint: FAIL resume: {found.refusal}", file=sys.stderr)
    return 0 if found.intact else 1


def _name(found: Findings, report: StepReport) -> str:
    """A step's folder name; the step folder given, as given."""
    return report.path if report.path == found.path else os.path.basename(report.path)


def _print(found: Findings) -> None:
    """The verdicts, on stdout."""
    if found.steps:
        print(f"{found.path}: {len(found.steps)} step folder(s), {found.steps[0]} to "
              f"{found.steps[-1]}; {LATEST}: " + (
                  os.path.basename(found.resumes) if found.resumes else
                  f"{os.path.basename(found.named)} (no such folder)" if found.named else
                  "none"))
    if found.writer:
        print(f"a run writes {found.path} now ({found.writer}): a step it is saving reads "
              "INCOMPLETE until its save finishes, and latest moves then")
    for report in found.reports:
        if report.intact:
            print(f"{_name(found, report)}: intact: {report.files} files, "
                  f"{size_text(report.bytes)}, every SHA-256 matches {MANIFEST} "
                  f"({report.seconds:.1f} s)")
        else:
            print(f"{_name(found, report)}: {'DAMAGED' if report.complete else 'INCOMPLETE'}: "
                  + "; ".join(report.problems) + (
                      f"; left after {os.path.basename(found.resumes or '')}, which a resume "
                      "loads: it ignores this folder (its save of that step, if any, replaces "
                      "it; else it may be deleted)"
                      if report.leftover else ""))
        if report.meta:
            print(f"  {_summary(report.meta)}")
    if found.refusal:
        print(f"resume: {found.refusal}")
    resumed = next((r for r in found.reports if r.path == found.resumes), None)
    if resumed is not None and resumed.intact and not found.intact:
        print(f"resume: {LATEST} names {os.path.basename(resumed.path)}, which is intact: a "
              "resume loads it")
    if found.instead:
        name = os.path.basename(found.instead)
        print(f"the newest intact step to resume from is {name}: echo {name} > "
              f"{os.path.join(os.path.dirname(found.instead), LATEST)}")
    elif not found.intact and any(report.complete for report in found.reports) and \
            (resumed is None or not resumed.intact):
        print("no intact step to resume from instead: start over in another checkpoint.dir")
