"""``mimo-inspect checkpoint``: whether a run's checkpoints are intact, and what each holds,
without starting a run (before a resume; after copying a checkpoint to another cluster).

Each checkpoint's files are hashed against its manifest (``digests``) by a few threads in this
one process, the check a resume makes before it loads anything; its ``meta.json`` says the
step, the layout, the global batch size and the model it was saved with.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field

from mimo_train.checkpoint_folders import LATEST, STEP_NAME, latest
from mimo_train.components import digests
from mimo_train.components.digests import MANIFEST
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

    @property
    def intact(self) -> bool:
        return self.complete and not self.problems


@dataclass
class Findings:
    """What ``inspect`` found at the path it was given."""
    path: str
    latest: str | None               # the step folder a resume loads (``latest``)
    steps: list[str]                 # a checkpoint.dir's step folders, oldest first
    reports: list[StepReport]
    notes: list[str] = field(default_factory=list)   # what a resume would make of the folder


def _step_folders(root: str) -> list[str]:
    return sorted(name for name in os.listdir(root) if re.fullmatch(STEP_NAME, name)
                  and os.path.isdir(os.path.join(root, name)))


def inspect(path: str, every: bool = False, workers: int = 4) -> Findings:
    """Check the checkpoint at ``path``: a step's folder, or a checkpoint.dir (the step its
    ``latest`` names, else its newest; ``every``: each of its steps). CheckpointError where
    ``path`` holds no checkpoint."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    steps = _step_folders(path)
    if not steps:
        if not os.path.exists(os.path.join(path, MANIFEST)) and \
                not os.path.exists(os.path.join(path, "meta.json")):
            model = " (a transformers model: that is a model.pretrained)" if \
                os.path.isfile(os.path.join(path, "config.json")) else ""
            raise CheckpointError(f"{path} holds no mimo checkpoint{model}: give a run's "
                                  "checkpoint.dir or one of its step_NNNNNNN folders")
        return Findings(path, None, [], [check(path, workers)])
    found = latest(path)
    notes = []
    if found is None:
        complete = any(os.path.isfile(os.path.join(path, name, MANIFEST)) for name in steps)
        notes.append(f"no '{LATEST}' file: a resume refuses this folder" + (
            f" (to resume from an intact step: echo step_NNNNNNN > "
            f"{os.path.join(path, LATEST)})" if complete else ""))
    elif not os.path.isdir(found):
        notes.append(f"{os.path.join(path, LATEST)} names {os.path.basename(found)}, which is "
                     "not there: a resume refuses this folder")
    chosen = steps if every else [os.path.basename(found)] if found else steps[-1:]
    reports = [check(os.path.join(path, name), workers) for name in chosen]
    if found and not os.path.isdir(found):
        reports.insert(0, StepReport(found, False, [f"{LATEST} names it; no such folder"]))
    return Findings(path, found, steps, reports, notes)


def check(directory: str, workers: int = 4) -> StepReport:
    """One step folder's files against its manifest, and its meta.json."""
    report = StepReport(directory, os.path.isfile(os.path.join(directory, MANIFEST)))
    try:
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
        report.meta = meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        pass
    if not report.complete:
        report.problems.append(f"no {MANIFEST}: its save did not finish (a run killed while "
                               "saving); a resume cannot use it")
        return report
    if report.meta is None:
        report.problems.append("meta.json is missing or unreadable")
    try:
        expected, sizes = digests.read_manifest(directory)
    except IntegrityError as error:
        report.problems.append(str(error))
        return report
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
        parts.append("LoRA")
    return "; ".join(parts)


def _size(count: int) -> str:
    if count < 1024:
        return f"{count:,} bytes"
    scaled, unit = count / 1024, "KiB"
    for larger in ("MiB", "GiB", "TiB"):
        if scaled < 1024:
            break
        scaled, unit = scaled / 1024, larger
    return f"{scaled:.1f} {unit}"


def main(args) -> int:
    """The subcommand (``args``: ``directory``, ``all``, ``workers``, ``json``): 0 when every
    checkpoint checked is intact, 1 when one is damaged or unfinished, 2 when the path holds
    no checkpoint."""
    try:
        found = inspect(args.directory, args.all, args.workers)
    except CheckpointError as error:
        print(f"mimo-inspect checkpoint: error: {error}", file=sys.stderr)
        return 2
    status = 0 if all(report.intact for report in found.reports) and not found.notes else 1
    if args.json:
        print(json.dumps({"path": found.path, "latest": found.latest, "steps": found.steps,
                          "notes": found.notes, "intact": status == 0, "checkpoints": [
                              {**asdict(report), "intact": report.intact}
                              for report in found.reports]}, indent=1))
        return status
    if found.steps:
        _say(f"{found.path}: {len(found.steps)} step folder(s), {found.steps[0]} to "
             f"{found.steps[-1]}; {LATEST}: "
             f"{os.path.basename(found.latest) if found.latest else 'none'}")
    for report in found.reports:
        name = os.path.basename(report.path) if found.steps else report.path
        if report.intact:
            _say(f"{name}: intact: {report.files} files, {_size(report.bytes)}, every SHA-256 "
                 f"matches {MANIFEST} ({report.seconds:.1f} s)")
        else:
            _say(f"{name}: {'DAMAGED' if report.complete else 'INCOMPLETE'}: "
                 + "; ".join(report.problems), failed=True)
        if report.meta:
            _say(f"  {_summary(report.meta)}")
    for note in found.notes:
        _say(note, failed=True)
    damaged = [report for report in found.reports if not report.intact]
    if damaged and found.steps:
        _say(_instead(found, damaged), failed=True)
    return status


def _say(line: str, failed: bool = False) -> None:
    """A line on stdout, or, for what fails the check, on stderr (stdout flushed first, so a
    terminal shows them in order)."""
    if failed:
        sys.stdout.flush()
    print(line, file=sys.stderr if failed else sys.stdout, flush=failed)


def _instead(found: Findings, damaged: list[StepReport]) -> str:
    """What to resume from instead: the newest intact checkpoint this check saw, or the newest
    earlier complete one, unchecked."""
    intact = [report.path for report in found.reports if report.intact]
    oldest = min(os.path.basename(report.path) for report in damaged)
    earlier = [name for name in found.steps if name < oldest
               and os.path.isfile(os.path.join(found.path, name, MANIFEST))]
    if intact:
        name = os.path.basename(intact[-1])
        return (f"the newest intact checkpoint here is {name}: resume from it with 'echo "
                f"{name} > {os.path.join(found.path, LATEST)}'")
    if earlier:
        return (f"an earlier checkpoint is {earlier[-1]} (not checked: --all checks every "
                "step)")
    return f"no earlier checkpoint is in {found.path}"
