"""The interface every modality implements, from build-time probing to inspection.

A modality (``image``, ``audio``, ``video``) owns everything that differs between kinds of
media: the text marker and member names, its config section, probing the encoded bytes at build
time, the token count of an item from its metadata alone, decoding, the encoder's inputs, and
how ``mimo-inspect`` shows an item. The rest of mimo reaches it through the registry in
``mimo_data.modalities`` and never branches on a modality's name.
"""

from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, NotRequired, TYPE_CHECKING, TypedDict

from mimo_data.errors import ConfigError
from mimo_data.tally import CountedError

if TYPE_CHECKING:     # torch is imported where used: metadata commands start without it
    import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` (an encoder's constants and indices, a step's counts). To a
    GPU it goes through page-locked memory without blocking: a blocking copy would first wait
    for all the work queued on the device."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def require_positive(section: str, config: Any, *names: str) -> None:
    """ConfigError naming the first of ``config``'s ``names`` (sizes, rates, a tuple's each)
    that is not above 0: a zero there would fail later, far from the config, as a division by
    zero or a tensor of negative size."""
    kinds = {field.name: str(field.type) for field in dataclasses.fields(config)}
    for name in names:
        given = getattr(config, name)
        values = given if isinstance(given, tuple) else (given,)
        if not all(value > 0 for value in values):
            # the field's kind, not the value's: a duration of 0 is below 0.5 s too
            bound = "above 0" if "float" in kinds[name] else "at least 1"
            raise ConfigError(f"modalities.{section}.{name} is {given!r}: "
                              f"{'each' if isinstance(given, tuple) else 'it'} must be {bound}")


class MediaError(CountedError):
    """A media item that cannot be used; ``reason`` is the report category."""


def item_name(item) -> str:
    """A media item as a message names it: its member, and its source file where it came from
    one (``vid0.mp4 (videos/pan.mp4)``: the member alone is the same in every sample)."""
    path = item.get("path")
    return f"{item['member']} ({path})" if path else item["member"]


class MediaItem(TypedDict):
    """One media item of ``KEY.json``; the fields after ``bytes`` are its modality's
    (``Modality.item_fields``, written by ``Modality.probe``)."""
    modality: str                # a registered modality: "image", "audio", "video"
    member: str                  # member suffix after "KEY.": "img0.jpg"
    format: str                  # container format: "jpeg", "png", "wav", "flac", "mp4", ...
    bytes: int
    path: NotRequired[str | None]  # the source file, when the media came from one
    width: NotRequired[int]      # image: size after EXIF orientation, Pillow's mode
    height: NotRequired[int]
    mode: NotRequired[str]
    orientation: NotRequired[int]
    sample_rate: NotRequired[int]  # audio: as decoded, before resampling
    channels: NotRequired[int]
    frames: NotRequired[int]     # audio and video
    duration: NotRequired[float]
    codec: NotRequired[str]      # video: FFmpeg's codec name, average frame rate, display
    fps: NotRequired[float]      # rotation (counter-clockwise degrees; width and height are
    rotation: NotRequired[int]   # after it)


class Modality(ABC):
    """One kind of media. Subclasses are stateless: one instance each, in the registry."""

    name: ClassVar[str]                    # "image": config key, batch key, default module name
    marker: ClassVar[str]                  # "<image>": the marker in conversation text
    member_prefix: ClassVar[str]           # "img": members are KEY.img0.jpg, KEY.img1.png, ...
    extensions: ClassVar[dict[str, str]]   # container format -> member file extension
    config_class: ClassVar[type]           # the dataclass of ``modalities.<name>``
    item_fields: ClassVar[tuple[str, ...]]  # metadata an item of the shard JSON must have
    verified_fields: ClassVar[tuple[str, ...]]  # metadata ``verify`` re-derives from the bytes
    # metadata kept per item in samples.parquet (column ``<name>_<field>``), by Arrow type
    # name: what ``mimo-shard info`` summarizes without opening a shard
    summary_fields: ClassVar[dict[str, str]]
    # whether ``take`` can pick items (and ``cut_units`` parts of them) out of encoder inputs:
    # what ``data.split_media`` needs of every modality it spreads over encoder ranks
    takes_parts: ClassVar[bool] = False
    # modules its sizes and encoder inputs import where they use them, not at the top:
    # transformers' (seconds and ~80 MiB with torchvision) that no ``mimo-shard`` command needs
    libraries: ClassVar[tuple[str, ...]] = ()
    ansi_color: ClassVar[str]              # its placeholders in ``mimo-inspect sample``
    html_color: ClassVar[str]              # ... and in the HTML report

    def load_libraries(self) -> None:
        """Import ``libraries`` now: a process about to preprocess does, so that the workers
        it forks share them instead of each importing its own."""
        for name in self.libraries:
            importlib.import_module(name)

    def member(self, item_index: int, fmt: str) -> str:
        """Member suffix (after ``KEY.``) of this modality's ``item_index``-th item."""
        return f"{self.member_prefix}{item_index}.{self.extensions[fmt]}"

    @abstractmethod
    def probe(self, data: bytes, check: str, max_image_pixels: int) -> dict[str, Any]:
        """Build time: validate encoded bytes, return the item's metadata (MediaError if not
        usable). ``check``: ``decode`` walks all data, ``header`` only headers."""

    @abstractmethod
    def decoded_metadata(self, data: bytes) -> dict[str, Any]:
        """``verify``: the metadata of a full decode, without size limits (any error raised)."""

    @abstractmethod
    def tokens(self, item: Mapping[str, Any], config: Any) -> int:
        """Placeholder tokens of an item, from its metadata alone (ValueError/KeyError if the
        metadata cannot give one)."""

    @abstractmethod
    def item_tokens(self, item: MediaItem, config: Any) -> int:
        """``tokens`` for training: MediaError (reason = the drop category) for an item the
        config cannot use (too long, an unsupported shape, ...)."""

    def token_grid(self, item: Mapping[str, Any], config: Any) -> tuple[int, int, int] | None:
        """The (time, height, width) grid the item's placeholder tokens lie on, in that order
        (multimodal rotary positions); None: a sequence, positioned like text."""
        return None

    def time_interval(self, item: Mapping[str, Any], config: Any) -> float:
        """Multimodal rotary positions: the time position step between the grid's time
        slices (1: one per slice)."""
        return 1.0

    def placeholder_texts(self, item: Mapping[str, Any], config: Any) -> tuple[str, ...]:
        """Texts before each run of the item's placeholders when they are cut into runs along
        the grid's time (one per slice, each between the modality's wrap tokens, all of them
        between the wrap tokens again: Qwen3-VL's video timestamps); (): one run."""
        return ()

    @abstractmethod
    def variable_tokens(self, config: Any) -> bool:
        """Whether items can give different token counts under ``config``."""

    @abstractmethod
    def decode(self, data: bytes, item: MediaItem, config: Any) -> Any:
        """Decode an item's bytes as the encoder inputs need them (MediaError if unusable)."""

    @abstractmethod
    def encoder_inputs(self, decoded: list, config: Any) -> dict[str, torch.Tensor]:
        """The encoder's keyword arguments for decoded items, item by item."""

    @abstractmethod
    def rows_to_tokens(self, inputs: dict[str, torch.Tensor], config: Any) -> list[int]:
        """Tokens the encoder emits per item for ``inputs`` (must equal ``item_tokens``)."""

    def cut_units(self, item: Mapping[str, Any], config: Any) -> int:
        """Equal runs of the item's placeholder tokens (and encoder-input rows), in order,
        between which ``data.split_media`` may cut it: a clip's temporal patches; 1: whole."""
        return 1

    def take(self, inputs: dict[str, torch.Tensor], config: Any,
             pieces: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """The encoder inputs of ``pieces`` of ``inputs`` (``encoder_inputs``' output), in
        that order: each ``(item, first, stop)``, the item's units ``first..stop - 1`` of its
        ``cut_units``."""
        raise NotImplementedError(f"{self.name} inputs cannot be taken apart")

    @abstractmethod
    def describe(self, item: Mapping[str, Any]) -> str:
        """A short human description of an item's metadata (``mimo-inspect sample``)."""

    def frame_times(self, item: Mapping[str, Any], config: Any) -> list[float] | None:
        """Seconds from the start of the frames the encoder gets of the item (clips), from its
        metadata; None: the modality has no frames (ValueError if none can be sampled)."""
        return None

    @abstractmethod
    def preview_png(self, data: bytes, item: Mapping[str, Any], config: Any
                    ) -> tuple[bytes, str]:
        """A small PNG of the item for the HTML report (thumbnail, spectrogram) and a problem
        line ("" if none) when the decoded item disagrees with its metadata."""


def take_grid_rows(pixels: torch.Tensor, grids: torch.Tensor,
                   pieces: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``pixels`` (``[Σ t·h·w, ...]``, item after item, each t-major) and ``[t, h, w]``
    grid rows of ``pieces`` (``(item, first, stop)``: temporal slices ``first..stop - 1``):
    each piece's rows are one contiguous range, its grid ``[stop - first, h, w]``."""
    import torch
    sizes = grids.prod(1)
    starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]).tolist()
    shapes = grids.tolist()
    rows, taken = [], []
    for item, first, stop in pieces:
        t, h, w = shapes[item]
        if not 0 <= first < stop <= t:
            raise ValueError(f"temporal slices {first}..{stop - 1} of an item of {t}")
        rows.append(pixels[starts[item] + first * h * w:starts[item] + stop * h * w])
        taken.append([stop - first, h, w])
    return (torch.cat(rows) if rows else pixels[:0],
            torch.tensor(taken, dtype=grids.dtype).reshape(-1, 3))
