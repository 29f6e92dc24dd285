"""``data.split_media``: one language rank's media rows cut over the encoder ranks that fan in
to it (docs/layouts-and-loader.md, "Long videos: media split over the encoder ranks").

Without it, an encoder module with k times the language model's DP ranks gives each of its
ranks 1/k of the language rank's samples, whole. With it, each of the k ranks reads all of
them and keeps part j of k of their media: the items of the module's modalities in placeholder
order (sample after sample, and within a sample as its placeholders come), cut into k
contiguous parts of near-equal tokens, only between an item's ``cut_units`` (a clip's
temporal patches; images and other items whole). The bridge concatenates the k ranks' rows
in rank order on the language rank, which is then exactly the rows of the whole micro-batch,
in the order the language model splices them: one long clip is encoded by several ranks.
That needs a tower that encodes each unit on its own (``Encoder.frame_independent``: the
Qwen2-VL family's, whose attention, positions and windows stay within a temporal patch;
CLIP's and SigLIP's, which take images alone, each encoded on its own).

Pure numpy over one micro-batch's metadata: nothing per sample is kept beyond it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from mimo_data.loading.layout import Layout, LayoutError
from mimo_data.modalities import MODALITIES


class Item(NamedTuple):
    """A media item of a micro-batch, in placeholder order."""
    sample: int             # its sample's index in the micro-batch
    modality: str
    item: int               # its index among the sample's items of that modality
    units: int              # ``cut_units``: where it may be cut
    tokens: int             # its placeholder tokens


class Piece(NamedTuple):
    """Units ``first..stop - 1`` of an item (all of them: the whole item)."""
    sample: int
    modality: str
    item: int
    first: int
    stop: int
    tokens: int


def check_split_media(layout: Layout, config) -> None:
    """LayoutError unless ``data.split_media`` can work on ``layout`` with the preprocessing
    ``config``: some encoder module fans in (more DP ranks than the language model's, on ranks
    of its own), and each modality it serves can be taken apart (``Modality.takes_parts``).
    Whether its tower encodes a clip's temporal patches independently is the trainer's rule
    (``mimo_train.plan.rules``)."""
    language = layout.language
    fanning = [m for m in layout.encoders if layout.fans_in(m)]
    if not fanning:
        raise LayoutError(
            f"data.split_media cuts each language rank's media over the encoder ranks that fan "
            f"in to it, and layout {layout} has none (an encoder module with more DP ranks "
            f"than {language.name!r}'s {language.dp}, on ranks of its own): drop "
            f"data.split_media, or give the tower's module more ranks, e.g. "
            f"'image=dp{2 * language.dp},video;{language.name}=dp{language.dp}'")
    for module in fanning:
        for modality in layout.modalities_of(module.name):
            if modality in config.modalities and not MODALITIES[modality].takes_parts:
                raise LayoutError(
                    f"data.split_media: module {module.name!r} serves {modality}, whose "
                    "encoder inputs mimo does not take apart (images and videos only): drop "
                    "data.split_media (fan-in then gives each encoder rank whole samples)")


def placeholder_order(ids: np.ndarray, token_counts: Mapping[str, Sequence[int]],
                      token_ids: Mapping[str, int]) -> list[tuple[str, int]]:
    """A sample's items of the modalities of ``token_counts`` as ``(modality, index among
    its items)``, in the order of their first placeholders in ``ids``."""
    starts: list[int] = []
    keys: list[tuple[str, int]] = []
    for modality, counts in token_counts.items():
        if not len(counts):
            continue
        at = np.flatnonzero(ids == token_ids[modality])
        if len(at) != sum(counts):
            raise ValueError(f"{len(at)} {modality} placeholders, token counts {list(counts)}")
        firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        starts += at[firsts].tolist()
        keys += [(modality, k) for k in range(len(counts))]
    return [keys[i] for i in np.argsort(starts, kind="stable")]


def cut(items: Sequence[Item], parts: int) -> list[list[Piece]]:
    """``items`` (in placeholder order) cut into ``parts`` contiguous parts of near-equal
    tokens, each cut at the unit boundary nearest to its share (a part may be empty)."""
    units = np.array([item.units for item in items], dtype=np.int64)
    tokens = np.array([item.tokens for item in items], dtype=np.int64)
    if (tokens % np.maximum(units, 1)).any() or (units < 1).any():
        raise ValueError(f"items whose tokens do not cut into their units: {list(items)}")
    per_unit = np.repeat(tokens // np.maximum(units, 1), units)
    bounds = np.concatenate([[0], np.cumsum(per_unit)])
    total = int(bounds[-1])
    cuts = [0]
    for j in range(1, parts):
        nearest = int(np.argmin(np.abs(bounds * parts - total * j)))
        cuts.append(max(nearest, cuts[-1]))
    cuts.append(len(per_unit))
    first_unit = np.concatenate([[0], np.cumsum(units)])
    owner = np.repeat(np.arange(len(items)), units)
    found: list[list[Piece]] = []
    for low, high in zip(cuts, cuts[1:]):
        pieces = []
        if low < high:
            for index in range(int(owner[low]), int(owner[high - 1]) + 1):
                item = items[index]
                first = max(low, int(first_unit[index])) - int(first_unit[index])
                stop = min(high, int(first_unit[index + 1])) - int(first_unit[index])
                pieces.append(Piece(item.sample, item.modality, item.item, first, stop,
                                    item.tokens // item.units * (stop - first)))
        found.append(pieces)
    return found
