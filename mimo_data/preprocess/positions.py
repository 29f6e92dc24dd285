"""Position ids of a sample's tokens: ``sequential`` (0, 1, 2, ...) or ``mrope``.

``mrope`` (multimodal rotary positions, Qwen2-VL's M-RoPE) gives every token three positions,
(time, height, width). A text token has all three equal, one more than the previous token's
largest; the tokens of an item laid out on a grid (an image's merged patches, row by row) share
the time position of the item's start and take its start plus their row and column as height
and width; the text after the item continues from the item's largest position plus one.
Items without a grid (audio) are positioned like text. This is the published Qwen2-VL and
Qwen2.5-VL checkpoints' own rule (Qwen's ``get_rope_index``, transformers up to 5.2, vLLM),
computed from the grids in the metadata: language ranks still decode no media. transformers
from 5.3 continues the text at the item's start plus its grid's larger side: the same for an
image, not for a clip whose time positions pass that side
(``families.qwen2_vl.use_published_positions``; the tests check both). Written here rather
than called: transformers' is a method of a built model and works on batched torch tensors
group by group, where a sample's ids take a few numpy operations per item in the preprocessor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

POSITIONS = ("sequential", "mrope")


def sequential_positions(length: int) -> np.ndarray:
    """``[length]`` int64: 0, 1, 2, ..."""
    return np.arange(length, dtype=np.int64)


def mrope_positions(ids: np.ndarray,
                    items: Sequence[tuple[int, int, tuple | None, float]]) -> np.ndarray:
    """``[3, len(ids)]`` int64 (time, height, width) positions of ``ids``.

    ``items``: per media item in placeholder order, ``(placeholder token id, token count,
    (t, h, w) grid or None, time interval)``; each item's placeholders are the next ``count``
    occurrences of its token id.
    """
    positions = np.empty((3, len(ids)), np.int64)
    hits = {token: np.flatnonzero(ids == token) for token in {item[0] for item in items}}
    used = dict.fromkeys(hits, 0)
    cursor = start = 0                          # next token to place; its position
    for token, count, grid, interval in items:
        first = used[token]
        used[token] += count
        if grid is None:
            continue
        at = int(hits[token][first])
        positions[:, cursor:at] = start + np.arange(at - cursor)
        start += at - cursor
        t, h, w = grid
        if t * h * w != count:
            raise ValueError(f"a grid of {t}x{h}x{w} for {count} tokens")
        block = positions[:, at:at + count].reshape(3, t, h, w)
        times = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
        block[0] = start + times[:, None, None]
        block[1] = start + np.arange(h)[None, :, None]
        block[2] = start + np.arange(w)[None, None, :]
        start += max(int(times[-1]) + 1, h, w)
        cursor = at + count
    positions[:, cursor:] = start + np.arange(len(ids) - cursor)
    return positions
