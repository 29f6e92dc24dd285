"""Turn one source task into a validated sample (messages, or a caption's or document's text;
media bytes and metadata) or a skip.

Runs in build worker processes: reads media, probes them, and returns everything the writer
needs, so the main process only assigns keys and writes.
"""

from __future__ import annotations

import base64
import io
import math
import os
import re
import urllib.parse
from dataclasses import dataclass, field

import numpy as np
import soundfile

from mimo_data.files import not_found
from mimo_data.modalities import MODALITIES, MediaError
from mimo_data.modalities.video.frames import frames_clip, frames_list_clip
from mimo_data.shards import storage
from mimo_data.shards.format import VIDEOS_FROM_FRAMES, VIDEOS_ROTATED, conversation_counts
from mimo_data.shards.records import (RecordError, media_markers, normalize_caption,
                                      normalize_document, normalize_messages)
from mimo_data.shards.sources import Task


@dataclass(frozen=True)
class MediaFile:
    """A validated media file to be read again by the writer (instead of piping its bytes)."""
    path: str
    size: int

    def read(self) -> bytes:
        """The file's bytes; RecordError if it changed size since validation."""
        try:
            with open(self.path, "rb") as media:
                data = media.read()
        except OSError as exc:
            raise RecordError("missing_media",
                              f"{self.path} vanished during the build: {exc}") from None
        if len(data) != self.size:
            raise RecordError("missing_media", f"{self.path} changed during the build "
                              f"({self.size} bytes when validated, {len(data)} now)")
        return data


@dataclass
class Prepared:
    """A record that passed validation; ``media`` is in marker order, like ``payloads``.
    ``messages`` of a conversation, ``text`` of a caption or a document (``kind``)."""
    id: str | None
    location: str
    source: dict
    messages: list[dict]
    media: list[dict]
    payloads: list[bytes | MediaFile]
    kind: str = "conversation"
    text: str | None = None
    # what the record holds that the build report counts (``records.media_markers``',
    # ``format.conversation_counts``, the frames clips made)
    counts: dict[str, int] = field(default_factory=dict)

    def media_bytes(self) -> list[bytes]:
        """The payloads as bytes (reading back deferred files)."""
        return [p.read() if isinstance(p, MediaFile) else p for p in self.payloads]


@dataclass
class Rejected:
    reason: str
    location: str
    detail: str
    id: str | None = None      # the record's own, where it was read and has one


@dataclass(frozen=True)
class MediaPolicy:
    max_image_pixels: int
    check: str                 # "decode" | "header"
    defer_files: bool = False  # return MediaFile for files: worker processes pipe no bytes
    markers_first: bool = False   # ``records.media_markers``: place missing markers first
    frames_fps: float | None = None   # a video given as a folder of frames: shown so fast


# a media reference that is base64 text, not a path: long, of base64's letters alone (a
# path has a dot before its extension, which base64 never writes)
_BASE64_ITEM = re.compile(r"[A-Za-z0-9+/\s]{256,}={0,2}\s*")


def _base64(text: str, what: str) -> bytes:
    """``text`` decoded (line-wrapped too, 76 columns as MIME writes it); RecordError saying
    ``what`` it was where it is not base64."""
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except ValueError:
        raise RecordError("malformed_record", f"{what} is not valid base64") from None


MAX_SAMPLING_RATE = 1_000_000         # Hz: above any audio's (768 kHz the highest in use)


def _wav_of(ref: dict) -> bytes:
    """A clip given decoded (Hugging Face datasets' ``Audio()`` feature: ``{array,
    sampling_rate, path}``) as float WAV bytes of those samples, not of the file its ``path``
    names, which a ``map`` that cut or edited the array no longer is (soundfile writes it:
    the audio modality reads WAV). Float samples in [-1, 1] as ``datasets`` decodes them, one
    channel or several (channels first, as ``mono=False`` gives them, or last); anything else
    is refused rather than guessed at."""
    rate = ref.get("sampling_rate")
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.number)) or \
            not math.isfinite(rate) or not 0 < rate <= MAX_SAMPLING_RATE or \
            not float(rate).is_integer():
        raise RecordError("malformed_record", f"a decoded audio array with sampling_rate "
                          f"{rate!r}: give its rate in Hz beside it, or the file's bytes "
                          "({bytes, path}: datasets' Audio(decode=False))")
    try:
        samples = np.asarray(ref["array"])
        if samples.dtype.kind not in "fiu":
            raise ValueError(f"{samples.dtype} values")
    except (TypeError, ValueError) as exc:
        raise RecordError("malformed_record", f"a decoded audio array that is no array of "
                          f"numbers ({exc})") from None
    if samples.dtype.kind in "iu":
        raise RecordError("malformed_record", "a decoded audio array of integers: give float "
                          "samples in [-1, 1] (16-bit PCM divided by 32768), or the file's "
                          "bytes")
    if samples.ndim == 2 and samples.shape[0] < samples.shape[1]:
        samples = samples.T                 # channels first (datasets' mono=False): frames
    if samples.ndim not in (1, 2) or (samples.ndim == 2 and samples.shape[1] > 8):
        raise RecordError("malformed_record", f"a decoded audio array of shape "
                          f"{samples.shape}: give its samples, one row per channel, or the "
                          "file's bytes")
    peak = float(np.abs(samples).max()) if samples.size else 0.0
    if not math.isfinite(peak) or peak > 2.0:
        raise RecordError("malformed_record", f"a decoded audio array whose samples reach "
                          f"{peak:g}: give float samples in [-1, 1] as datasets decodes them, "
                          "or the file's bytes")
    buffer = io.BytesIO()
    soundfile.write(buffer, samples.astype(np.float32), int(rate), format="WAV",
                    subtype="FLOAT")
    return buffer.getvalue()


def _read_media(ref, media_root: str, frames_fps: float | None = None,
                modality: str = "image") -> tuple[bytes, str | None, str | None, bool]:
    """Bytes, original path (a frame list's: ``_frames_path``) and resolved file (None for
    embedded bytes and a clip made of frames) of a media reference (a path, bytes,
    ``{bytes, path}`` or a decoded clip's ``{array, sampling_rate}``; a video's also a
    list of its frame files), and whether it named frames made one clip (a folder or a list
    of them, with ``frames_fps``)."""
    path, empty, video = None, "", modality == "video"
    if isinstance(ref, dict) and ref.get("array") is not None:
        if modality != "audio":
            raise RecordError("malformed_record", f"a decoded {modality} array: mimo reads "
                              f"the {modality}'s file; give its bytes ({{bytes, path}}) or "
                              "its path")
        return _wav_of(ref), ref.get("path"), None, False
    if isinstance(ref, dict):
        if isinstance(ref.get("bytes"), str) and ref["bytes"]:    # JSON holds bytes as base64
            text = ref["bytes"]
            cut = "..." if len(text) > 40 else ""
            return _base64(text, f"media bytes {text[:40]!r}{cut}, a string (how JSON holds "
                           "bytes: give base64, or a path),"), ref.get("path"), None, False
        if ref.get("bytes"):
            return bytes(ref["bytes"]), ref.get("path"), None, False
        path = ref.get("path")
        if ref.get("bytes") is not None and isinstance(path, str):  # b"": said with the path's
            empty = "its bytes are empty (0 bytes), and the path beside them: "
    elif isinstance(ref, (bytes, bytearray)):
        return bytes(ref), None, None, False
    elif isinstance(ref, str) and _BASE64_ITEM.fullmatch(ref) and \
            not os.path.exists(os.path.join(media_root, ref)):
        # an item's bytes as base64 text (ms-swift's images: "/9j/4AAQ..."), where no file
        # has that name (one without an extension might); text that does not decode: a path
        try:
            return _base64(ref, "media"), None, None, False
        except RecordError:
            path = ref
    elif isinstance(ref, str):
        path = ref
    elif video and isinstance(ref, list) and ref and all(isinstance(p, str) for p in ref):
        # a video as the list of its frame files (qwen-vl-utils' and LLaMA-Factory's form)
        if frames_fps is None:
            raise RecordError("missing_media", f"a video given as {len(ref)} frame files "
                              f"({ref[0][:80]!r}, ...): a video's frames are read with "
                              "--frames-fps, the rate they were taken at")
        given, frames = zip(*(_local_path(item, media_root) for item in ref))
        return _clip_of(list(frames), frames_fps), _frames_path(list(given)), None, True
    if not path or not isinstance(path, str):
        raise RecordError("malformed_record", f"media reference {str(ref)[:80]!r} has neither "
                          "bytes nor a path")
    if path.startswith("data:"):            # an inline item (OpenAI's image_url parts)
        return _data_url(path), None, None, False
    path, full = _local_path(path, media_root)
    if frames_fps is not None and os.path.isdir(full):     # a video as its frames
        return _clip_of(full, frames_fps), path, None, True
    try:
        with open(full, "rb") as media:
            return media.read(), path, full, False
    except FileNotFoundError:
        windows = "\\" in path and os.sep == "/"
        raise RecordError("missing_media", f"{empty}media file {full}: {not_found(full)} "
                          f"({RELATIVE_PATHS}" + (
                              "; this one is written with backslashes, as Windows writes "
                              "paths: write it with / (and without a drive letter)"
                              if windows else "") + ")") from None
    except IsADirectoryError:   # a video as a folder of its frames (LLaVA-Hound's, say)
        raise RecordError("missing_media", f"{full} is a folder, not a media file" + (
            ": a video's frames are read with --frames-fps, the rate they were taken at "
            "(LLaVA-Hound's: 2, TVQA's: 3)" if modality == "video" else
            f": give the {modality} file itself")) from None
    except (OSError, ValueError) as exc:  # ValueError: e.g. a NUL in the path
        shown = f"{full[:200]!r}" + (f"... ({len(full)} characters)" if len(full) > 200 else "")
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise RecordError("missing_media", f"cannot read media file {shown}: {why}") from None


def _frames_path(given: list[str]) -> str:
    """The path a list of frame files is named by in messages and the sample's media: the
    folder they share (as a frames folder is named), else the first frame's."""
    folders = {os.path.dirname(path) for path in given}
    return folders.pop() if len(folders) == 1 and "" not in folders else given[0]


def _local_path(path: str, media_root: str) -> tuple[str, str]:
    """The path a media path gives (a ``file://`` URL's path) and the file it names (a
    relative one joined to ``media_root``); RecordError for a URL of another host or scheme,
    and text that is not Unicode."""
    if path.startswith("file://"):
        url = urllib.parse.urlsplit(path)
        if url.netloc not in ("", "localhost"):
            raise RecordError("malformed_record", f"{path[:100]!r} names the host "
                              f"{url.netloc!r}: a file URL is file:///absolute/path (or give "
                              "the path itself, relative to the input file or --media-root)")
        path = urllib.parse.unquote(url.path)
    if path.lower().startswith(("http://", "https://")):    # joined to the root: nonsense
        raise RecordError("missing_media", f"{path[:100]!r} is a URL, which mimo does not "
                          "download: fetch it first (e.g. img2dataset) and give paths or bytes")
    if storage.is_remote(path):                             # s3://, gs://: the same
        raise RecordError("missing_media", f"{path[:100]!r} is an object store's URL, which "
                          "mimo-shard build does not read media from: copy the media beside "
                          "the input first (e.g. aws s3 sync) and give paths relative to it")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as exc:   # a lone surrogate from a "\ud800" escape
        raise RecordError("invalid_utf8", f"media path {path!r} is not valid Unicode: "
                          f"{exc}") from None
    return path, path if os.path.isabs(path) else os.path.join(media_root, path)


def _data_url(url: str) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URL (RFC 2397; the standard library
    parses none outside urllib's opener)."""
    header, comma, data = url[len("data:"):].partition(",")
    if not comma:
        raise RecordError("malformed_record", f"data URL {url[:60]!r}... has no ',' before "
                          "its data")
    if not header.lower().endswith(";base64"):
        return urllib.parse.unquote_to_bytes(data)
    return _base64(data, f"the base64 data of {url[:60]!r}... (a data: URL's, or an "
                   "input_audio part's)")


# A manifest's ``duration`` may differ from its file's by this much (rounding, encoder
# padding); more, and the line is a segment of the file or the file is cut short.
DURATION_TOLERANCE_S = 0.1
DURATION_TOLERANCE_FRACTION = 0.02


def check_audio_duration(declared: float, probed: float, where: str) -> None:
    """RecordError ``duration_mismatch`` when a manifest's ``declared`` duration and the
    ``probed`` file's differ by more than max(0.1 s, 2 % of the file's)."""
    tolerance = max(DURATION_TOLERANCE_S, DURATION_TOLERANCE_FRACTION * probed)
    if declared == 0 and probed > tolerance:     # a writer's "unknown", not a segment
        raise RecordError("duration_mismatch", f"{where}: the manifest's 'duration' is 0 but "
                          f"the file holds {probed:g} s: give its length, or leave the field "
                          "out")
    if abs(declared - probed) > tolerance:
        raise RecordError("duration_mismatch", f"{where}: the manifest's 'duration' is "
                          f"{declared:g} s but the file holds {probed:g} s (tolerance "
                          f"{tolerance:.2g} s). mimo does not cut segments: cut each segment "
                          "into a file of its own first; if the file is cut short, export "
                          "it again; if the 'duration' is wrong, fix it")


def _clip_of(frames: str | list[str], fps: float) -> bytes:
    """The clip of a folder of frames (``frames_clip``) or a list of frame files
    (``frames_list_clip``), with their refusals as the report's."""
    shown = frames if isinstance(frames, str) else f"the frame {frames[0]}" \
        if len(frames) == 1 else f"the {len(frames)} frames from {frames[0]}"
    try:
        return frames_clip(frames, fps) if isinstance(frames, str) else \
            frames_list_clip(frames, fps)
    except MediaError as exc:
        raise RecordError.of_media(exc, shown) from None
    except OSError as exc:
        raise RecordError("missing_media", f"cannot read the frames in {shown}: {exc}") \
            from None


# A document is one sample: one image it cannot read skips all of it; how to keep the rest
# (by the document's form: texts/images, or MMC4's).
DOCUMENT_MEDIA_REMEDY = {"": "the whole document is skipped: to keep the rest, set that image "
                             "to null in the record's 'images' list",
                         "mmc4": "the whole document is skipped: to keep the rest, remove that "
                                 "image from the record's 'image_info' (MMC4's images that "
                                 "could not be fetched are left out so)"}


# what a missing_media skip of a local file not found says of its path (``build`` counts them)
RELATIVE_PATHS = "paths are relative to the input file's folder, or to --media-root"


def _where(modality: str, index: int, path: str | None) -> str:
    return f"{modality} {index}" + (f" ({path})" if path else "")


def prepare(task: Task, source, policy: MediaPolicy) -> Prepared | Rejected:
    """Load, normalize and validate one record; never raises for bad input."""
    record_id = None
    try:
        raw = source.load(task)
        record_id = raw.id
        messages, text, refs = [], None, raw.media
        counts: dict[str, int] = {}
        if raw.kind == "document":
            text, images = normalize_document(raw.text, raw.media.get("image"))
            refs = {"image": images}
            order = ["image"] * len(images)
        elif raw.kind == "caption":
            text = normalize_caption(raw.text, refs)
            order = [modality for modality, items in refs.items() if items]
        else:
            messages = normalize_messages(raw.turns, raw.tools, raw.system, raw.objects)
            order, counts = media_markers(
                messages, {modality: len(items) for modality, items in refs.items()},
                policy.markers_first)
            counts.update(conversation_counts(messages))
        media, payloads, seen = [], [], dict.fromkeys(MODALITIES, 0)
        for modality in order:
            index = seen[modality]
            seen[modality] += 1
            try:
                data, path, file, from_frames = _read_media(
                    refs[modality][index], source.media_root,
                    policy.frames_fps if modality == "video" else None, modality)
                try:
                    meta = MODALITIES[modality].probe(data, policy.check,
                                                      policy.max_image_pixels)
                except MediaError as exc:
                    raise RecordError.of_media(exc, _where(modality, index, path)) from None
                except MemoryError:
                    raise
                except Exception as exc:    # a decoding library failing on a file no check
                    # of ours foresaw: this record's skip, not the end of a long build
                    raise RecordError(f"corrupt_{modality}", f"{_where(modality, index, path)}: "
                                      f"reading it failed ({type(exc).__name__}: {exc}); if "
                                      f"the file {'opens' if modality == 'image' else 'plays'} "
                                      "elsewhere, convert it with ffmpeg") from None
            except RecordError as exc:
                if raw.kind != "document":
                    raise
                raise RecordError(exc.reason, f"{exc.detail}; "
                                  f"{DOCUMENT_MEDIA_REMEDY[raw.form]}") from None
            if from_frames:
                counts[VIDEOS_FROM_FRAMES] = counts.get(VIDEOS_FROM_FRAMES, 0) + 1
            if meta.get("rotation"):
                counts[VIDEOS_ROTATED] = counts.get(VIDEOS_ROTATED, 0) + 1
            if modality == "audio" and raw.audio_duration is not None:
                check_audio_duration(raw.audio_duration, meta["duration"],
                                     _where(modality, index, path))
            media.append({"modality": modality,
                          "member": MODALITIES[modality].member(index, meta["format"]),
                          "bytes": len(data), "path": path, **meta})
            payloads.append(MediaFile(file, len(data)) if file and policy.defer_files else data)
    except RecordError as exc:
        if record_id is None:                   # refused while it was read
            record_id = source.record_id(task)
        return Rejected(exc.reason, task.location, exc.detail, record_id)
    kind, number = task.origin
    return Prepared(id=raw.id, location=task.location,
                    source={"file": source.path, kind: number},
                    messages=messages, media=media, payloads=payloads, kind=raw.kind,
                    text=text, counts=counts)
