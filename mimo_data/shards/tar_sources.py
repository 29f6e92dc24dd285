"""What ``mimo-shard index`` is asked to index: its options, the tars its sources name (a
folder, an Energon dataset folder, tar paths, globs or brace patterns, local or URLs) and the
member map of their layout (given, Energon's ``field_map``, or detected from the first tar)."""

from __future__ import annotations

import glob
import json
import os
import posixpath
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import braceexpand

from mimo_data.modalities import MARKERS
from mimo_data.modalities.image import DEFAULT_MAX_IMAGE_PIXELS
from mimo_data.shards import energon, storage
from mimo_data.files import COMPRESSIONS
from mimo_data.shards.format import CLAIM_FILE, FORMAT_NAME, INDEX_FILE
from mimo_data.shards.layouts import MEDIA_EXTENSIONS, MemberMap, detect, field as member
from mimo_data.shards.records import RecordError
from mimo_data.shards.sources import SourceError
from mimo_data.shards.tar_walk import NotATarError, Walked, not_in_place, walk

DETECT_SAMPLES = 16           # samples of the first tar that decide the layout
# a compressed tar's names: .tar and each compression's suffix (.tar.gz), or one that says both
COMPRESSED_TARS = tuple(suffix if suffix == ".tgz" else f".tar{suffix}"
                        for kind, (_, suffixes) in COMPRESSIONS.items() if kind != "zip"
                        for suffix in suffixes)


class IndexInputError(SourceError):
    """The command cannot run as asked (an input or output in the way): exit 2."""


@dataclass
class IndexOptions:
    layout: str = "auto"                  # auto | pairs | conversation | documents | energon
    media_member: str | None = None       # pairs: the medium (default: the one media member)
    text_member: str = "txt"
    json_member: str = "json"
    name: str | None = None
    workers: int = 1
    check: str = "decode"
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    overwrite: bool = False
    progress: bool = True
    markers_first: bool = False           # conversation: place missing markers first
    strict: bool = False                  # the first record skipped stops the indexing
    keys_per_tar: bool = False            # tars number their samples each on their own: TAR/KEY
    split: str = "train"                  # an Energon folder's split.yaml split indexed


@dataclass(frozen=True)
class Source:
    """The tars to index: names relative to ``root`` (a local directory or a URL), and the
    samples an Energon split.yaml excludes (``TAR/KEY``)."""
    root: str
    shards: list[str]
    mapping: MemberMap
    sample_excludes: frozenset[str] = frozenset()
    detected_from: str = ""         # the tar the layout was detected from (others checked)
    counts: dict[str, int] = field(default_factory=dict)   # samples a tar holds (Energon's)
    counts_file: str = ""                                  # where they were read
    given: tuple[str, ...] = ()     # the sources as given (a folder, tars, globs, patterns)




# folder names of a dataset's splits that are not for training (a folder of tars indexed
# whole would take them in without a word)
HELD_OUT_FOLDERS = {"val", "valid", "validation", "test", "eval", "dev", "heldout", "held_out"}


def _folders(root: str, path: str) -> list[str]:
    """The folders between ``root`` and the file ``path`` under it."""
    relative = path[len(root):].strip("/") if storage.is_remote(root) else \
        os.path.relpath(path, root)
    return relative.replace(os.sep, "/").split("/")[:-1]


def _expand(pattern: str) -> list[str]:
    return list(braceexpand.braceexpand(pattern))


def _is_pattern(path: str) -> bool:
    return any(c in path for c in "*?[")


def _hidden(root: str, path: str) -> bool:
    """Whether the file ``path`` under ``root`` is hidden or in a hidden folder, as a shell
    glob (webdataset's ``DIR/*.tar``) leaves it out: macOS's ``._NAME.tar`` beside each tar
    copied off a Mac, a tar set aside as ``.old.tar``; Energon's ``.nv-meta`` and its files
    are not."""
    folders = _folders(root, path)
    return any(folder.startswith(".") and folder != energon.META for folder in folders) or (
        posixpath.basename(path.replace(os.sep, "/")).startswith(".")
        and folders[-1:] != [energon.META])


def _list_files(location: str, storage_options: dict | None) -> list[str]:
    """Every file under ``location`` (hidden folders and files too: ``_hidden``), sorted."""
    if storage.is_remote(location):
        remote = storage.Remote(location, storage_options)
        protocol = location.partition("://")[0]
        found = remote.retried(f"listing {location}",
                               lambda: remote.fs.find(location, detail=False))
        paths = [p if "://" in p else f"{protocol}://{p}" for p in found]
    else:
        paths, walked = [], set()
        # a dataset's parts mounted as linked folders are under it too; each real folder once
        # (a link back up would loop)
        for folder, folders, names in os.walk(storage.local_path(location), followlinks=True):
            real = os.path.realpath(folder)
            if real in walked:
                folders[:] = []
                continue
            walked.add(real)
            folders[:] = [name for name in folders
                          if not name.startswith(".") or name == energon.META]
            paths += [os.path.join(folder, name) for name in names]
    return sorted(paths)


def _glob(pattern: str, storage_options: dict | None) -> list[str]:
    if storage.is_remote(pattern):
        remote = storage.Remote(pattern, storage_options)
        protocol = pattern.partition("://")[0]
        found = remote.retried(f"listing {pattern}", lambda: remote.fs.glob(pattern))
        # hidden names matched only by a pattern naming them (.x*), as Python's glob (fsspec's
        # matches macOS's ._NAME.tar with *.tar)
        hidden = posixpath.basename(pattern).startswith(".")
        return sorted(p if "://" in p else f"{protocol}://{p}" for p in found
                      if hidden or not posixpath.basename(p).startswith("."))
    return sorted(os.path.abspath(p) for p in glob.glob(storage.local_path(pattern)))


def _is_dir(location: str) -> bool:
    """Whether ``location`` names a folder (at a URL: neither a tar nor a pattern)."""
    if storage.is_remote(location):
        return not location.lower().endswith(".tar") and not _is_pattern(location)
    return os.path.isdir(storage.local_path(location))


def _energon_counts(root: str, storage_options: dict | None) -> tuple[dict[str, int], str]:
    """``energon.shard_counts`` as ``Source`` holds them; a file that does not read is said and
    checks nothing (it only ever warns)."""
    try:
        location, counts = energon.shard_counts(root, storage_options)
    except SourceError as exc:
        say(f"warning: {exc}; the tars' sample counts are not checked")
        return {}, ""
    return counts, location


def _a_folder(path: str, storage_options: dict | None) -> bool:
    """Whether ``path`` (that exists) is a folder: a URL's prefix too, asked of its store
    unless it names a tar (a glob's thousands of matches are no request each)."""
    if storage.is_remote(path):
        if path.lower().endswith(".tar"):
            return False
        remote = storage.Remote(path, storage_options)
        return remote.retried(f"looking at {path}", lambda: bool(remote.fs.isdir(path)))
    return os.path.isdir(storage.local_path(path))


def _root_of(paths: list[str]) -> str:
    """The deepest folder holding every path (a URL's or a local one)."""
    if not storage.is_remote(paths[0]):
        return os.path.commonpath([os.path.dirname(p) for p in paths])
    protocol = paths[0].partition("://")[0] + "://"
    if any(not p.startswith(protocol) for p in paths):
        raise IndexInputError("the tars must all be local or all under one URL scheme")
    return protocol + posixpath.commonpath([posixpath.dirname(p[len(protocol):])
                                            for p in paths])


def output_given_as_source(sources: list[str], storage_options: dict | None) -> None:
    """IndexInputError for ``index SRC OUT`` without ``--output`` (as cp reads it): a last
    source that is not there, nor a tar, nor a pattern, is the output meant."""
    last = sources[-1]
    if len(sources) > 1 and not _is_pattern(last) and "{" not in last and \
            not last.lower().endswith(".tar") and not storage.exists(last, storage_options):
        raise IndexInputError(f"{last}: no such tar or folder to index; to write the index "
                              f"there, give it as --output: mimo-shard index "
                              f"{' '.join(sources[:-1])} --output {last}")


def resolve(sources: list[str], options: IndexOptions,
            storage_options: dict | None = None) -> Source:
    """The tars ``sources`` name (a folder, an Energon dataset folder, tar paths, globs or
    brace patterns, local or URLs) and their member map (the layout given or detected);
    ``--markers-first`` for a layout without markers to place is refused (never a flag
    silently unused)."""
    try:
        source = _resolve(sources, options, storage_options)
    except FileNotFoundError as exc:   # a bucket that is not there (s3fs, at its listing)
        raise IndexInputError(f"{' '.join(sources)}: not there ({exc}): check the bucket and "
                              "the prefix") from None
    if options.markers_first and source.mapping.layout != "conversation":
        raise IndexInputError(f"--markers-first places a conversation's markers, and the "
                              f"layout is {source.mapping.layout}: leave it out")
    return replace(source, given=tuple(
        s if storage.is_remote(s) else os.path.abspath(s) for s in sources))


def _not_found(location: str, what: str, storage_options: dict | None) -> IndexInputError:
    """``location`` is not there: ``what``, unless its bucket is missing (said as such)."""
    absent = storage.bucket_absence(location, storage_options)
    return IndexInputError(f"{location}: " + (
        what if absent is None else storage.bucket_missing(location, storage_options, absent)
        + ": check the URL and the endpoint"))


def _resolve(sources: list[str], options: IndexOptions,
             storage_options: dict | None) -> Source:
    """``resolve``'s tars and member map."""
    folder_given = len(sources) == 1 and _is_dir(sources[0])
    if folder_given:
        root = sources[0].rstrip("/") if storage.is_remote(sources[0]) else \
            os.path.abspath(storage.local_path(sources[0]))
        if _a_mimo_dataset(root, storage_options):
            raise IndexInputError(f"{root} is a mimo dataset already (its {INDEX_FILE}, as "
                                  "mimo-shard build writes it): give it as it is (data.datasets,"
                                  " mimo-inspect, mimo-shard info); nothing to index")
        if storage.exists(storage.join(root, CLAIM_FILE), storage_options):
            raise IndexInputError(f"{root} holds a mimo-shard build's claim ({CLAIM_FILE}): its "
                                  "tars are a build still running, or one stopped before its "
                                  f"{INDEX_FILE}, some of the records at most: run that build "
                                  "again (it takes the folder over once its writer has ended); "
                                  "nothing to index")
        if energon.is_energon(root, storage_options):
            # an Energon folder's split.yaml decides its tars whatever --layout reads them (its
            # validation parts are no training data: --split val indexes them apart)
            names, excludes, left_out = energon.split_tars(root, options.split, storage_options)
            if left_out:                # said, as the excluded samples are counted
                say(f"{storage.join(root, energon.META, energon.SPLIT_YAML)}'s exclude leaves "
                    f"out {len(left_out)} tar(s) of the {options.split} split: "
                    f"{', '.join(left_out[:3])}{' ...' if len(left_out) > 3 else ''}")
            missing = [name for name in names if not storage.is_remote(root)
                       and not os.path.isfile(os.path.join(root, name))]
            if missing:
                raise IndexInputError(f"{storage.join(root, energon.META, energon.SPLIT_YAML)} "
                                      f"lists {len(missing)} tar(s) not in {root}, e.g. "
                                      f"{missing[0]}: restore the tar(s) (moved, or not "
                                      "copied with the rest?), or, if they are gone for good, "
                                      "run `energon prepare` again to list the tars there are")
            if options.layout in ("auto", "energon"):
                named = [flag for flag, value, default in (
                    ("--media-member", options.media_member, None),
                    ("--text-member", options.text_member, "txt"),
                    ("--json-member", options.json_member, "json")) if value != default]
                if named:
                    raise IndexInputError(f"{' '.join(named)}: an Energon folder's field_map "
                                          "names its members; give --layout pairs (or "
                                          "conversation, documents) to name them yourself")
                mapping, unread = energon.member_map(root, storage_options)
                say(f"layout energon: {storage.join(root, energon.META)} "
                    f"({mapping.describe()}), {len(names)} {options.split} tar(s)")
                if mapping.layout == "pairs":
                    fields = f"{storage.join(root, energon.META, energon.DATASET_YAML)}'s field_map"
                    first, head, _ = _head(root, names, storage_options)
                    _check_pair_members(storage.join(root, first), head, [
                        (f"{fields} image", mapping.media), (f"{fields} caption", mapping.text)])
                for sentence in unread:
                    say(sentence)
                counts, counts_file = _energon_counts(root, storage_options)
                return Source(root, names, mapping, frozenset(excludes), counts=counts,
                              counts_file=counts_file)
            split = storage.join(root, energon.META, energon.SPLIT_YAML)
            say(f"{len(names)} {options.split} tar(s) of {split}, read as --layout "
                f"{options.layout}")
            mapping, _ = _member_map(root, names, options, storage_options)   # as given
            counts, counts_file = _energon_counts(root, storage_options)
            return Source(root, names, mapping, frozenset(excludes), counts=counts,
                          counts_file=counts_file)
        if options.layout == "energon":
            raise IndexInputError(f"{root}: no {energon.META}/{energon.DATASET_YAML}; run "
                                  "`energon prepare` there, or choose another --layout")
    if folder_given:
        files: list[str] = []
        hidden: list[str] = []
        for path in _list_files(root, storage_options):
            (hidden if _hidden(root, path) else files).append(path)
        # left out as a shell's glob leaves them, not without a word (a local walk does not
        # enter hidden folders: their tars are not listed to be said)
        tars = [path for path in hidden if path.lower().endswith(".tar")]
        if tars:
            apple = sum(posixpath.basename(path).startswith("._") for path in tars)
            say(f"{root}: {len(tars)} hidden tar(s) left out, e.g. "
                f"{'/'.join([*_folders(root, tars[0]), posixpath.basename(tars[0])])}" + (
                    f" ({apple} of them macOS's ._NAME, the metadata it writes beside each "
                    "file it copies: no tar)" if apple else "") +
                ": name a hidden tar to index it")
        below = _energon_below(files)
        if below:
            raise IndexInputError(f"{root} holds the Energon dataset {below}: give that "
                                  "folder, whose split.yaml's train split (and its excludes) "
                                  "mimo reads (--split val: its validation split), or a "
                                  "folder of other tars")
        paths = [p for p in files if p.lower().endswith(".tar")]     # 00001.TAR too
        # never a folder's data left out without a word: compressed tars beside plain ones
        compressed = [p for p in files if p.lower().endswith(COMPRESSED_TARS)]
        if not files:
            raise _not_found(root, "no *.tar files under it", storage_options)
        if not paths or compressed:
            raise IndexInputError(f"{root}: " + (
                f"{len(compressed)} compressed tar(s) beside the {len(paths)} plain one(s)"
                if paths else "no *.tar files under it") + (
                f" (e.g. {compressed[0]}: {not_in_place(compressed[0])})" if paths else
                f" ({len(compressed)} compressed, e.g. {compressed[0]}: "
                f"{not_in_place(compressed[0])})"
                if compressed else ""))
        held_out = sorted({folder for path in paths for folder in _folders(root, path)
                           if folder.lower() in HELD_OUT_FOLDERS})
        if held_out:
            raise IndexInputError(f"{root}: tars under {', '.join(held_out)}/ too, a split held "
                                  "out from training by its name: give the training split's "
                                  "folder, or name the tars to index (a glob or brace "
                                  "pattern) to train on these as well")
    else:
        if options.layout == "energon":
            raise IndexInputError("--layout energon takes the dataset folder (the one holding "
                                  f"{energon.META}/)")
        paths = []
        for given in sources:
            for path in _expand(given):
                if _is_pattern(path):
                    matched = _glob(path, storage_options)
                    if not matched:
                        raise _not_found(path, "matches no file", storage_options)
                    folder = next((p for p in matched if _a_folder(p, storage_options)), None)
                    if folder:
                        raise IndexInputError(f"{path} matches the folder {folder}: name the "
                                              "tars (a glob such as 'A/*.tar')")
                    paths += matched
                elif not storage.exists(path, storage_options):
                    raise _not_found(path, "no such file" + (
                        f" (of the pattern {given})" if path != given else ""), storage_options)
                elif _a_folder(path, storage_options):
                    raise IndexInputError(
                        f"{path} is a folder, given with other sources: index one folder at a "
                        "time (separate downloads may number their keys alike) and train on "
                        "the indexes together (data.datasets: [A, B]), or name the tars (a "
                        "glob such as 'A/*.tar')")
                elif path.lower().endswith((".yaml", ".yml")):
                    folder = os.path.dirname(path.rstrip("/"))
                    if os.path.basename(folder) == ".nv-meta":      # a dataset's own YAML
                        raise IndexInputError(
                            f"{path}: a YAML file of the Energon dataset "
                            f"{os.path.dirname(folder)}, not a tar: give that folder")
                    raise IndexInputError(f"{path}: a YAML file (an Energon metadataset?), not "
                                          "a tar: index each dataset folder it names, and "
                                          "blend them with the training config's data "
                                          "weights")
                else:
                    paths.append(path if storage.is_remote(path) else
                                 os.path.abspath(storage.local_path(path)))
        paths = list(dict.fromkeys(paths))
        if not paths:
            raise IndexInputError("no tars given")
        root = _root_of(paths)
    # a folder of tars, or tars given: each one's folder (a glob may reach several datasets)
    inside = energon_above([root] if folder_given else dict.fromkeys(
        [*(posixpath.dirname(p) if storage.is_remote(p) else os.path.dirname(p)
           for p in paths), root]), storage_options)
    if inside:
        # its split.yaml decides which tars train: its validation and test parts, and the
        # samples it excludes, would train unseen
        shown = root if folder_given else next(
            (p for p in paths if p.startswith(inside.rstrip("/") + "/")), root)
        raise IndexInputError(f"{shown} is inside the Energon dataset {inside}: give that "
                              "folder, whose split.yaml's train split (and its excludes) "
                              "mimo reads (--split val: its validation split), not its tars" + (
                                  "" if folder_given or len(paths) == 1 else
                                  f" (one of the {len(paths)} tars given)"))
    if options.split != "train":            # (an Energon folder's was read above)
        raise IndexInputError(f"--split {options.split}: a split of an Energon dataset's "
                              f"{energon.SPLIT_YAML}; give the dataset's folder (one with "
                              f"{energon.META}/), or leave --split out")
    names = [posixpath.relpath(p, root) if storage.is_remote(root) else os.path.relpath(p, root)
             for p in paths]
    mapping, first = _member_map(root, names, options, storage_options)
    return Source(root, names, mapping, detected_from=first)



def _a_mimo_dataset(folder: str, storage_options: dict | None) -> bool:
    """Whether ``folder`` holds a mimo dataset's index (``mimo-shard build``'s output)."""
    index = storage.join(folder, INDEX_FILE)
    try:
        return storage.exists(index, storage_options) and json.loads(
            storage.read_bytes(index, storage_options)).get("format") == FORMAT_NAME
    except storage.StorageError:        # unknown (the store kept failing): said, not guessed
        raise
    except (OSError, ValueError, AttributeError):     # not one: indexed as its tars
        return False


def _energon_below(files: list[str]) -> str | None:
    """The folder of an Energon dataset among a folder's ``files`` (``_list_files``), if
    any: its split.yaml, not a folder's listing, decides its tars."""
    marker = f"/{energon.META}/{energon.DATASET_YAML}"
    return next((path[:-len(marker)] for path in files if path.endswith(marker)), None)


# members a caption is written in, by their last suffix (a refusal names them as pairs)
_CAPTION_SUFFIXES = {"txt", "text", "caption", "captions", "cap", "desc", "description", "alt"}


def energon_above(folders: Iterable[str], storage_options: dict | None) -> str | None:
    """The Energon dataset folder holding one of ``folders`` (it, or up to
    ``energon.DEPTH`` folders above), if any; each folder asked once."""
    asked: dict[str, bool] = {}
    for start in folders:
        remote = storage.is_remote(start)
        protocol, _, path = start.partition("://") if remote else ("", "", start)
        for _ in range(energon.DEPTH + 1):
            folder = f"{protocol}://{path}" if remote else path
            if folder not in asked:
                asked[folder] = energon.is_energon(folder, storage_options)
            if asked[folder]:
                return folder
            parent = posixpath.dirname(path) if remote else os.path.dirname(path)
            if parent in ("", path):             # past the top folder, or the bucket
                break
            path = parent
    return None


def _head(root: str, names: list[str], storage_options: dict | None
          ) -> tuple[str, list[dict[str, bytes]], list[str]]:
    """The first tar of ``names`` that holds a sample, its first samples' members (up to
    ``DETECT_SAMPLES``) and the keys met twice among them with no member in common (a tar
    whose members of one key are not together, its halves apart; a sample twice, written
    again with a member more, say, is a duplicate, counted as such); an empty tar first, or
    one cut short in its first member, decides nothing. ("", [], []) where none holds
    one."""
    for name in names:
        head: list[dict[str, bytes]] = []
        runs: dict[str, set[frozenset[str]]] = {}       # key -> the suffixes of each run
        with open_tar(storage.join(root, name), storage_options) as tar:
            try:
                for sample in walk(tar, Walked(), storage.join(root, name)):
                    head.append({suffix: m.data for suffix, m in sample.members.items()})
                    runs.setdefault(sample.key, set()).add(frozenset(sample.members))
                    if len(head) == DETECT_SAMPLES:
                        break
            except NotATarError as exc:
                raise IndexInputError(f"{storage.join(root, name)}: {exc}") from None
        if head:
            return name, head, split_keys(runs)
    return "", [], []


def split_keys(runs: dict[str, set[frozenset[str]]]) -> list[str]:
    """The keys whose runs of members (key -> the suffixes of each run) have none in common: a
    tar whose members of one key are apart (a sample written twice, with a member more, say,
    is a duplicate)."""
    return sorted(key for key, held in runs.items() if any(
        not one & other for one in held for other in held if one is not other))


# how to write a tar whose members of one key are apart
_REWRITE = ("webdataset reads a sample as one run of members, so each would be read as "
            "several samples. Write the tar with each sample's files one after another (tar "
            "-cf x.tar --sort=name -C FOLDER . , not tar cf x.tar *.jpg *.txt, which keeps the "
            "order given), or with webdataset's ShardWriter")


def members_apart(head: list[dict[str, bytes]], split: list[str], layout: str | None,
                  json_member: str) -> str | None:
    """Why a tar's first samples ``head`` (``split``: its keys whose runs share no member)
    show its members of one key apart, for the ``layout`` read (None: none detected); None
    where they do not. A tar of one member per sample is said so where the layout reads more:
    conversations whose markers have no medium beside them, or lone members of one kind."""
    lone = {suffix for members in head for suffix in members} \
        if head and all(len(members) == 1 for members in head) else set()
    if layout == "conversation" and lone == {json_member} and all(
            any(marker.encode() in members[json_member] for marker in MARKERS.values())
            for members in head):
        # every one would be dropped: its markers have no medium to stand for
        return (f"each of its first {len(head)} samples is a KEY.{json_member} conversation "
                "with media markers and no medium beside it. If the tar holds the media "
                "further on (tar cf x.tar *.json *.jpg), the members of one key are apart: "
                f"{_REWRITE}")
    if split:               # whatever the samples read whole say of the layout
        return (f"the members of one key are apart (key {split[0]!r} comes back after other "
                f"keys, with none of its members before): {_REWRITE}")
    if layout in (None, "pairs") and len(lone) == 1:
        suffix = lone.pop()
        return (f"each of its first {len(head)} samples is one {suffix} member. If the tar "
                "holds their other files further on, the members of one key are apart: "
                f"{_REWRITE}. If it holds {suffix} files alone, nothing in it is a caption or "
                "conversation to train on")
    return None


def _member_map(root: str, names: list[str], options: IndexOptions,
                storage_options: dict | None) -> tuple[MemberMap, str]:
    """The member map of ``options``, the layout detected from the first samples when
    ``--layout auto``; and the tar it was detected from ("" where it was not)."""
    layout = options.layout
    pairs_options = options.media_member is not None or options.text_member != "txt"
    if layout in ("conversation", "documents") and pairs_options:
        raise IndexInputError(f"--media-member / --text-member name a caption pair's members; "
                              f"--layout {layout} reads each sample's KEY.{options.json_member} "
                              "and the media beside it: leave them out, or give --layout pairs")
    detected, first = None, ""
    head: list[dict[str, bytes]] = []
    if layout == "auto" or (layout == "pairs" and pairs_options):
        first, head, split = _head(root, names, storage_options)
    if layout == "auto":
        if not first:
            raise IndexInputError(f"{root}: no sample in its {len(names)} tar(s) (empty, or cut "
                                  "short within their first member): nothing to index")
        detected = detect(head, options.json_member)
        if detected not in (None, "pairs") and pairs_options:
            raise IndexInputError(f"{storage.join(root, first)}: its samples are "
                                  f"{detected.removesuffix('s')}s, "
                                  "and --media-member / --text-member name a caption pair's "
                                  "members: leave them out, or give --layout pairs")
        layout = detected or ("pairs" if pairs_options else "")
        apart = members_apart(head, split, layout or None, options.json_member)
        if apart:
            raise IndexInputError(f"{storage.join(root, first)}: {apart}")
        if not layout:
            seen = sorted({suffix for members in head for suffix in members})
            # one medium beside one text member (KEY.caption, KEY.text): a pair, so named (not
            # a class label, an array, JSON metadata: no caption)
            media = [s for s in seen if s.rpartition(".")[2].lower() in MEDIA_EXTENSIONS]
            texts = [s for s in seen if s not in media and s != options.json_member]
            pair = f" (here: --layout pairs --text-member {texts[0]})" \
                if len(media) == 1 and len(texts) == 1 and \
                texts[0].rpartition(".")[2].lower() in _CAPTION_SUFFIXES else ""
            # x.0.json, x.1.json: keys with a dot (numbered after it); KEY.conv.json: a JSON
            # member's own name
            named = [s for s in seen if s.endswith(f".{options.json_member}")]
            numbered = [s for s in named if s.partition(".")[0].isdigit()]
            dotted = numbered[0] if len(numbered) > 1 else None
            if named and not dotted:
                pair = " (here, where one is a conversation: --layout conversation " \
                    f"--json-member {' or '.join(named[:3])})"
            raise IndexInputError(f"{storage.join(root, first)}: its first samples, of members "
                                  f"{', '.join(seen[:12]) or 'none'} (after each key's first "
                                  "dot), are neither caption pairs (a medium beside KEY.txt), "
                                  f"conversations (KEY.{options.json_member} with "
                                  "conversations/messages) nor documents (texts + images "
                                  "lists); " + (
                                      f"its keys hold a dot (a member {dotted!r}): webdataset's "
                                      "key ends at the first dot of a file name, so samples "
                                      "x.0 and x.1 are read as one sample x (no option reads "
                                      "them apart): write the tar again with keys without "
                                      "dots" if dotted else
                                      "give --layout and the --*-member options (pairs: "
                                      "--media-member and --text-member name them as listed)"
                                      + pair))
    if layout == "pairs":
        _check_pair_members(storage.join(root, first), head, [
            ("--media-member", options.media_member), ("--text-member", options.text_member)])
    mapping = MemberMap(layout, media=options.media_member, text=options.text_member,
                        json=options.json_member, markers_first=options.markers_first)
    how = ("as given" if options.layout != "auto" else f"detected from the first samples of {first}"
           if detected else "from the --media-member / --text-member options")
    say(f"layout {layout} ({how}): {mapping.describe()}")
    return mapping, first if detected else ""


def _check_pair_members(tar: str, head: list[dict[str, bytes]],
                        named: list[tuple[str, str | None]]) -> None:
    """IndexInputError where a caption pair's member as ``named`` (``(what names it, its
    spec)``: ``--media-member``, an Energon field_map's) is a member, or a JSON member's
    field, that none of the first samples of ``tar`` holds: every record would be skipped,
    found only after reading every tar."""
    for flag, spec in named:
        if spec is None or not head:
            continue
        unfound: RecordError | None = None      # a JSON member's, without the field
        for members in head:
            try:
                if member(members, spec, flag) is not None:
                    break
            except RecordError as error:
                unfound = unfound or error
        else:
            if unfound is not None:
                raise IndexInputError(f"{tar}: none of its first {len(head)} samples has the "
                                      f"field ({unfound.detail}): name a field they have")
            seen = sorted({suffix for members in head for suffix in members})
            raise IndexInputError(f"{tar}: {flag} {spec}: none of its first {len(head)} "
                                  f"samples holds that member (they hold {', '.join(seen[:12])}, "
                                  "after each key's first dot): name one of those")


def say(line: str) -> None:
    print(f"mimo-shard index: {line}", file=sys.stderr, flush=True)


def tar_version(tar: Any, location: str) -> str | None:
    """The version (``storage.version``) of the tar at ``location`` that ``open_tar`` opened
    as ``tar``, as it was opened."""
    details = getattr(tar, "details", None)     # fsspec's file: its lookup's entry
    if details is None:
        return storage.local_version(os.fstat(tar.fileno()))
    # fsspec's HTTP file keeps its size alone: the headers from a lookup, on its own client
    return storage.version(details) or storage.retried(
        f"looking up {location}", lambda: storage.version(tar.fs.info(location)))


def open_tar(location: str, storage_options: dict | None):
    if storage.is_remote(location):
        return storage.Remote(location, storage_options).fs.open(location, "rb",
                                                                  block_size=8 << 20)
    return open(storage.local_path(location), "rb", buffering=4 << 20)

