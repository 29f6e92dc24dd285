"""A Megatron-Energon dataset folder as ``mimo-shard index`` reads it: ``.nv-meta/dataset.yaml``
(the sample type and its ``field_map``), ``.nv-meta/split.yaml`` (a split's tars) and
``.nv-meta/.info.json`` (each tar's sample count, checked against the tars as read), as
``energon prepare`` writes them. Energon's own index (``index.sqlite``, ``*.tar.idx``) is not
needed: mimo reads the tars once and keeps its own tables.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Collection

import braceexpand
import yaml

from mimo_data.errors import listed, meant
from mimo_data.shards import storage
from mimo_data.shards.layouts import MemberMap
from mimo_data.shards.sources import SourceError

META = ".nv-meta"
DATASET_YAML = "dataset.yaml"
SPLIT_YAML = "split.yaml"
# how many folders above given tars are searched for an Energon dataset's .nv-meta
DEPTH = 3
INFO_JSON, INFO_YAML = ".info.json", ".info.yaml"     # each tar's sample count
OTHERWISE = ("index the folder with --layout pairs|conversation|documents and the --*-member "
             "options instead (split.yaml's train tars still)")


def is_energon(root: str, storage_options: dict | None = None) -> bool:
    return storage.exists(storage.join(root, META, DATASET_YAML), storage_options)


def _yaml(root: str, name: str, storage_options: dict | None) -> dict:
    location = storage.join(root, META, name)
    try:
        text = storage.read_bytes(location, storage_options)
    except FileNotFoundError:
        raise SourceError(f"{location}: missing; run `energon prepare {root}` first") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # [parts/data-{0..9}.tar] unquoted: YAML reads the braces as a mapping inside the list
        # (on the lines where the parser stopped, or the one before)
        mark = getattr(exc, "problem_mark", None)
        lines = text.splitlines()[max(mark.line - 1, 0):mark.line + 1] if mark else []
        braces = any(re.search(rb"\[[^\]\"']*\{", line) for line in lines)
        raise SourceError(f"{location}: not YAML ({exc})" + (
            "; a brace pattern inside [ ] must be quoted: [\"parts/data-{0..9}.tar\"]"
            if braces else "")) from None
    if not isinstance(loaded, dict):
        raise SourceError(f"{location}: expected a mapping, found {type(loaded).__name__}")
    return loaded


def _declared(dataset: dict, key: str) -> str:
    """The sample class's ``__class__`` or ``__module__`` (also the older top level's)."""
    declared = dataset.get("sample_type", dataset)
    return str(declared.get(key, "")) if isinstance(declared, dict) else ""


def sample_type(dataset: dict) -> str:
    """The sample class name (``CaptioningSample``), also from the older top-level
    ``__class__: CaptioningWebdataset``."""
    return _declared(dataset, "__class__").replace("Webdataset", "Sample")


# the field_map fields of the sample types mimo indexes
_FIELDS = {"CaptioningSample": ("image", "caption"), "VQASample": ("image", "context", "answers"),
           "VQAOCRSample": ("image", "context", "answers")}


# Energon's own sample types (megatron-energon 7), none a misspelling of another
ENERGON_TYPES = frozenset({
    "CaptioningSample", "VQASample", "VQAOCRSample", "OCRSample", "ImageSample",
    "ImageClassificationSample", "InterleavedSample", "SimilarityInterleavedSample",
    "MultiChoiceVQASample", "TextSample", "VidQASample", "CrudeSample"})


def member_map(root: str, storage_options: dict | None = None) -> tuple[MemberMap, list[str]]:
    """The layout of the dataset's ``field_map``: CaptioningSample's ``image`` + ``caption``
    are caption pairs, VQASample's ``image`` + ``context`` + ``answers`` a question-answer
    conversation. Other sample types and ``sample_loader`` code are refused (SourceError).
    And what of ``dataset.yaml`` mimo does not read, each said as a sentence: the keys that
    mean something to Energon's task encoders and nothing to mimo (``subflavors``: which
    prompt or task a sample is for), and field_map entries of fields the sample type lacks."""
    dataset = _yaml(root, DATASET_YAML, storage_options)
    module = _declared(dataset, "__module__")
    if module and module.split(".")[:2] != ["megatron", "energon"]:
        raise SourceError(f"{storage.join(root, META, DATASET_YAML)}: sample type "
                          f"{module}.{_declared(dataset, '__class__') or '?'}, a class of your own "
                          "(not Energon's): its samples are made by code mimo does not run; "
                          f"{OTHERWISE}")
    unread = [f"its {DATASET_YAML}'s {key} are not read: Energon's task encoders choose "
              "prompts by them, mimo's preprocessing config does"
              for key in ("subflavors", "subflavor") if dataset.get(key)]
    where = storage.join(root, META, DATASET_YAML)
    kind = sample_type(dataset)
    fields = dataset.get("field_map")
    if not isinstance(fields, dict):
        why = ("a sample_loader is Python code mimo does not run" if "sample_loader" in dataset
               else f"a {kind or 'sample type'}'s samples are made by code mimo does not run"
               if kind == "CrudeSample" else "nothing says which member is which")
        raise SourceError(f"{where}: no field_map ({why}); {OTHERWISE}")
    odd = {field: member for field, member in fields.items() if not isinstance(member, str)}
    if odd:
        field, member = next(iter(odd.items()))
        raise SourceError(f"{where}: field_map.{field} is {member!r}; energon maps each field "
                          "to one member name (jpg, or json[key] for a key of a JSON member)")
    needed = _FIELDS.get(kind, ())
    if missing := [name for name in needed if name not in fields]:
        unknown = sorted(set(fields) - set(needed) - {"answer_weights"})
        raise SourceError(f"{where}: field_map has no {', '.join(missing)}, which a {kind} "
                          "needs; " + (f"it has {', '.join(f'field_map.{u}' for u in unknown)}"
                                       f", no field of a {kind}"
                                       f"{meant(unknown, missing, 'field_map.')}" if unknown
                                       else f"its fields: {listed(sorted(fields))}")
                          + f": set {', '.join(f'field_map.{m}' for m in missing)} in "
                          f"{DATASET_YAML}, or {OTHERWISE}")
    extra = sorted(set(fields) - set(needed) - {"answer_weights"})
    if kind == "VQAOCRSample":      # its OCR fields beside the question's: mimo reads none
        unread += [f"{where}: field_map.{name} (a VQAOCRSample's OCR) is not read: mimo "
                   "trains the question and its answer" for name in extra]
    else:
        unread += [f"{where}: field_map.{name} names no field of a {kind} (its fields: "
                   f"{', '.join(needed)}{', answer_weights' if kind == 'VQASample' else ''}"
                   f"{meant([name], needed, 'field_map.')}; Energon refuses it): not read"
                   for name in extra]
    if kind == "CaptioningSample":                # each field it needs is there (above)
        return MemberMap("pairs", media=fields["image"], text=fields["caption"]), unread
    if kind in ("VQASample", "VQAOCRSample"):
        return MemberMap("vqa", media=fields["image"], question=fields["context"],
                         text=fields["answers"], weights=fields.get("answer_weights", "")), unread
    # a sample type of Energon's own is no misspelling of one mimo reads (OCRSample is not
    # VQAOCRSample)
    hint = "" if kind in ENERGON_TYPES else meant([kind], _FIELDS)
    raise SourceError(f"{where}: sample type {kind or '?'}{hint} with "
                      f"fields {listed(sorted(fields))}: mimo "
                      "indexes CaptioningSample (image, caption) and VQASample (image, context, "
                      f"answers); {OTHERWISE}")


def split_tars(root: str, name: str = "train", storage_options: dict | None = None
               ) -> tuple[list[str], set[str], list[str]]:
    """Split ``name``'s tars (``train``, or ``val`` for a validation set), relative to
    ``root``, in split.yaml's order (less the ``exclude`` entries naming a tar), the samples
    ``exclude`` drops as energon does (the entries holding a ``/`` after brace expansion,
    ``TAR/KEY``: TAR as split.yaml names it, KEY the member names' part before their first
    dot), and the split's tars it leaves out."""
    split = _yaml(root, SPLIT_YAML, storage_options)
    where = storage.join(root, META, SPLIT_YAML)
    named = split.get("split_parts") or {}
    parts = named.get(name) if isinstance(named, dict) else None
    if not parts:
        there = sorted(str(k) for k, v in named.items() if v) if isinstance(named, dict) else []
        raise SourceError(f"{where}: no {name} split_parts" + (
            f" (its splits: {', '.join(there)}: --split names one)" if there else ""))
    excluded = set(_expanded(where, "exclude", split.get("exclude") or []))
    listed = _expanded(where, f"split_parts.{name}", parts)
    shards = [tar for tar in listed if tar not in excluded]
    twice = sorted(tar for tar, count in Counter(shards).items() if count > 1)
    if twice:
        raise SourceError(f"{where}: split_parts.{name} lists {', '.join(twice[:3])} more "
                          "than once (each tar's samples would be read as many times): list "
                          "each tar once")
    return shards, {entry for entry in excluded if "/" in entry}, \
        list(dict.fromkeys(tar for tar in listed if tar in excluded))


def _expanded(where: str, key: str, patterns: object) -> list[str]:
    """The names split.yaml's list ``key`` gives, brace patterns expanded; SourceError for
    what energon refuses too (a string where a list belongs, an unbalanced brace)."""
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise SourceError(f"{where}: {key} is {patterns!r}; energon reads a list of tar names "
                          f"or brace patterns (`{key.split('.')[-1]}: [\"parts/data-{{0..9}}"
                          ".tar\"]`, a pattern quoted inside [ ], or one '- NAME' line each)")
    try:
        return [name for pattern in patterns for name in braceexpand.braceexpand(pattern)]
    except ValueError as error:          # braceexpand.UnbalancedBracesError
        raise SourceError(f"{where}: {key}: {error}") from None


def shard_counts(root: str, storage_options: dict | None = None) -> tuple[str, dict[str, int]]:
    """The file of ``energon prepare``'s sample counts (``.info.json``, or the older
    ``.info.yaml``) and the samples of each tar as it counted them (named as split.yaml names
    them); ("", {}) where neither is there. SourceError where it does not read as counts."""
    for name, parse in ((INFO_JSON, json.loads), (INFO_YAML, yaml.safe_load)):
        location = storage.join(root, META, name)
        try:
            info = parse(storage.read_bytes(location, storage_options))
            counts = info.get("shard_counts") or {} if isinstance(info, dict) else None
            if not isinstance(counts, dict):
                raise ValueError("no shard_counts mapping")
            return location, {str(tar): int(count) for tar, count in counts.items()}
        except FileNotFoundError:
            continue
        except (ValueError, TypeError, yaml.YAMLError) as exc:
            raise SourceError(f"{location}: not read as energon prepare's sample counts "
                              f"({exc})") from None
    return "", {}


def excluded_keys(shard: str, sample_excludes: Collection[str]) -> frozenset[str]:
    """The keys of ``shard``'s samples that ``sample_excludes`` (``TAR/KEY``) drop."""
    return frozenset(name[len(shard) + 1:] for name in sample_excludes
                     if name.startswith(f"{shard}/"))
