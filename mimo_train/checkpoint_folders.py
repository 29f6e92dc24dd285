"""A checkpoint.dir's folders and files by name, and what a resume makes of them: its steps'
folders, ``latest`` naming the last complete one, a step's ``meta.json`` and manifest. No
torch: the start-up's config checks and ``mimo-inspect checkpoint`` read them without building
anything (``components.checkpoint`` writes and loads the checkpoints)."""

from __future__ import annotations

import glob
import json
import os
import re

from mimo_train.errors import CheckpointError

LATEST = "latest"
META = "meta.json"
MANIFEST = "integrity.json"        # megatron-core's name (dist_checkpointing.validation)
STEP_NAME = r"step_\d{7}"          # a step's checkpoint folder in a checkpoint.dir


# the files of one step's save: torch.distributed.checkpoint's (its .metadata, its .distcp
# files), megatron-core's manifest (integrity.json), mimo's meta.json
_SAVED_FILES = re.compile(r"^(integrity\.json|\.metadata|.*\.distcp)$")
_STEP_FILES = re.compile(rf"{_SAVED_FILES.pattern}|^{re.escape(META)}$")


def is_step_folder(path: str) -> bool:
    """``path`` is one step's checkpoint (named ``step_NNNNNNN``, or holding a save's files
    and no step folders), not a run's checkpoint.dir: finished or not."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    if any(re.fullmatch(STEP_NAME, name) for name in names):
        return False
    return bool(re.fullmatch(STEP_NAME, os.path.basename(os.path.abspath(path)))) or \
        any(_STEP_FILES.match(name) for name in names)


def holds_a_save(path: str) -> bool:
    """``path`` holds one step's saved tensors or manifest itself (not in step folders): a
    step's checkpoint, which a run given it as its checkpoint.dir would write into (an empty
    folder named like a step, or one of a user's own files, is none)."""
    return os.path.isdir(path) and any(_SAVED_FILES.match(name) for name in os.listdir(path))


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:07d}")


def latest(root: str | None) -> str | None:
    """The checkpoint directory ``root/latest`` names, or None; CheckpointError (a damaged
    checkpoint.dir: exit status 1, as a ``latest`` naming no folder is) where ``latest`` is
    empty, a folder, cannot be read or names a folder outside ``root``."""
    if not root:
        return None
    path = os.path.join(root, LATEST)
    try:
        with open(path) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} cannot be read ({error}): it names the checkpoint to "
                              f"resume; write the step's folder name into it (echo "
                              f"step_NNNNNNN > {path})", damaged=True) from None
    if not name:
        raise CheckpointError(f"{path} holds {name!r}, no step's folder name: write the step to "
                              f"resume into it (echo step_NNNNNNN > {path})", damaged=True)
    found = os.path.normpath(os.path.join(root, name))
    if os.path.realpath(os.path.dirname(found)) != os.path.realpath(root):
        raise CheckpointError(f"{path} names {name}, not a folder of checkpoint.dir {root}: a "
                              "resume continues its own folder's steps (echo step_NNNNNNN > "
                              f"{path}); to start from another run's checkpoint, give "
                              f"model.init_from={found} and a checkpoint.dir of its own",
                              damaged=True)
    return os.path.join(root, name)


def step_of(path: str) -> str:
    """The step's checkpoint ``path`` names: a checkpoint.dir's latest (``latest``), as
    mimo-export takes it, else ``path`` itself."""
    return latest(path) or path


def complete_steps(root: str) -> list[str]:
    """The names of the step folders in ``root`` whose save finished (their manifest
    written), oldest first."""
    return sorted(name for name in os.listdir(root) if re.fullmatch(STEP_NAME, name)
                  and os.path.isfile(os.path.join(root, name, MANIFEST)))


def is_model_folder(root: str) -> bool:
    """``root`` holds a transformers model (its config.json beside safetensors or bin
    weights) and none of mimo's step folders."""
    if not os.path.isfile(os.path.join(root, "config.json")):
        return False
    names = os.listdir(root)
    return (not any(re.fullmatch(STEP_NAME, name) for name in names)
            and any(name.endswith((".safetensors", ".bin", ".safetensors.index.json"))
                    for name in names))


def resume_point(root: str | None) -> str | None:
    """The checkpoint a run with ``checkpoint.dir`` ``root`` resumes (``latest``), or None
    when it holds none; CheckpointError when it holds complete checkpoints (their manifest
    written) but no ``latest`` (a checkpoint copied there): neither ignoring them nor writing
    a new run beside them would be what was meant. A save interrupted before its manifest
    leaves nothing to resume: the run starts over."""
    found = latest(root)
    if found and root and not os.path.isdir(found):
        raise damaged(found, f"{os.path.join(root, LATEST)} names it, and there is no such "
                             "folder (removed, or latest written by hand?)")
    if found or not root or not os.path.isdir(root):
        return found
    steps = complete_steps(root)
    readable = [step for step in steps if meta_of(os.path.join(root, step)) is not None]
    if steps and not readable:
        raise CheckpointError(
            f"checkpoint.dir {root} holds {', '.join(steps[-3:])} but no '{LATEST}' file, and "
            f"no {META} of them reads: none can be resumed; start over in another "
            f"checkpoint.dir (or remove them: rm -r {os.path.join(root, 'step_*')})",
            damaged=True)
    if steps:
        raise CheckpointError(
            f"checkpoint.dir {root} holds {', '.join(steps[-3:])} but no '{LATEST}' file, "
            f"which names the checkpoint to resume: to resume from {readable[-1]}, run `echo "
            f"{readable[-1]} > {os.path.join(root, LATEST)}` (the resume checks its files "
            "against its manifest, and names the newest earlier step where one is damaged); to "
            "start a new run, give another checkpoint.dir")
    return None


def not_a_step(directory: str) -> None:
    """CheckpointError where ``directory`` is no step's checkpoint but something a user may
    give in its place: missing, a checkpoint.dir without ``latest`` (``step_of`` takes one
    with it) or a transformers model folder."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint {directory}: no such directory")
    names = set(os.listdir(directory))
    steps = sorted(name for name in names if re.fullmatch(STEP_NAME, name))
    if steps:
        raise CheckpointError(f"{directory} holds a run's checkpoints (a checkpoint.dir) and "
                              f"no '{LATEST}' naming one: give one step's folder, e.g. "
                              f"{os.path.join(directory, steps[-1])}")
    if "config.json" in names and any(name.endswith((".safetensors", ".bin"))
                                      for name in names):
        raise CheckpointError(f"{directory} is a transformers model (config.json and its "
                              "weights), not a mimo checkpoint: give it as model.pretrained (a "
                              "whole VLM) or model.language.pretrained")
    if not is_step_folder(directory):           # (a dataset, a run's folder above its own)
        below = sorted(os.path.dirname(path) for path in
                       glob.glob(os.path.join(directory, "*", STEP_NAME.replace(r"\d{7}",
                                                                                "[0-9]" * 7))))
        raise CheckpointError(f"{directory} holds no mimo checkpoint (no {META}, no step "
                              "folders, no latest): give a run's checkpoint.dir or one of its "
                              "step_NNNNNNN folders" + (f", e.g. {below[-1]}" if below else ""))


def earlier_steps(directory: str) -> list[str]:
    """The step folders beside ``directory`` a resume may fall back to, newest first: those
    whose manifest and readable meta.json are there, and, where ``directory`` is a step's,
    earlier ones only (a later one may be another run's; their files are checked when one is
    resumed)."""
    root = os.path.dirname(os.path.abspath(directory))
    name = os.path.basename(os.path.abspath(directory))
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, step) for step in reversed(complete_steps(root))
            if (not re.fullmatch(STEP_NAME, name) or step < name)
            and meta_of(os.path.join(root, step)) is not None]


def damaged(directory: str, what: str, init_from: bool = False) -> CheckpointError:
    """The refusal of a damaged checkpoint: what is wrong and the newest earlier one to
    resume instead (``earlier_steps``); ``init_from``: it was given as model.init_from (its
    folder may be another run's, whose latest is not this run's to set: the earlier one as
    model.init_from)."""
    root = os.path.dirname(os.path.abspath(directory))
    earlier = earlier_steps(directory)
    if earlier:
        which = "earlier checkpoint" if re.fullmatch(
            STEP_NAME, os.path.basename(os.path.abspath(directory))) else \
            "checkpoint beside it"      # a folder not named step_* has no place among them
        instead = (f"the newest {which} is {earlier[0]}: give model.init_from={earlier[0]}"
                   if init_from else
                   f"the newest {which} is {earlier[0]}: resume from it with "
                   f"'echo {os.path.basename(earlier[0])} > {os.path.join(root, LATEST)}' "
                   f"(or model.init_from={earlier[0]} for its weights)")
    else:
        name = os.path.basename(os.path.abspath(directory))
        unread = [step for step in complete_steps(root) if step != name and (
            not re.fullmatch(STEP_NAME, name) or step < name)] if os.path.isdir(root) else []
        instead = (f"no earlier checkpoint is in {root}" + (
            f" that can be resumed ({', '.join(unread[-3:])}: no {META} reads): start over "
            f"in another checkpoint.dir (or remove them all: rm -r "
            f"{os.path.join(root, 'step_*')} {os.path.join(root, LATEST)})" if unread else
            f": start over in another checkpoint.dir (or remove {directory} and "
            f"{os.path.join(root, LATEST)})"))
    return CheckpointError(f"checkpoint {directory} is damaged: {what}; {instead}", damaged=True,
                           what=what, earlier=earlier[0] if earlier else "")


def meta_of(directory: str) -> dict | None:
    """A step folder's ``meta.json``; None where it is missing or no JSON object (``read_meta``
    says which, for a resume)."""
    try:
        with open(os.path.join(directory, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def read_meta(directory: str) -> dict:
    """``meta.json`` of a complete checkpoint (its manifest readable too): no collective, so
    every rank can call it in a start-up phase; CheckpointError otherwise."""
    if glob.glob(os.path.join(directory, "rank_*.pt")):
        raise CheckpointError(
            f"{directory} is a checkpoint of an earlier mimo_train (one rank_*.pt file per "
            "rank), which this version does not read: train from model.language.pretrained or "
            "from scratch")
    not_a_step(directory)
    for name in (META, MANIFEST):
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                content = json.load(f)
            if not isinstance(content, dict) or (name == MANIFEST and
                                                 not isinstance(content.get("files"), dict)):
                raise ValueError("not the expected JSON object")
        except FileNotFoundError:
            raise damaged(directory, f"{path} is missing (the save did not finish)") from None
        except (OSError, ValueError) as error:
            raise damaged(directory, f"{path} is unreadable ({error})") from None
        if name == META:
            meta = content
    return meta
