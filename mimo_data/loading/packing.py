"""Sequence packing: each language DP rank's samples of a micro-batch packed into sequences of
at most ``seq_length`` tokens (``data.packing: true``).

The plan is a pure function of the samples' token counts (the token table), so every rank
computes the same one without communication. Within each part (the ``micro_batch_size``
samples a language DP rank gets per micro-batch), samples are placed first-fit-decreasing into
sequences of ``capacity`` tokens, then reordered so that each sequence's samples are
contiguous, sequences in the order they were opened. Only places within a part move: every
micro-batch keeps exactly its samples (exactly-once and resume are unchanged), and every
module still sees the same ordered global micro-batch, so encoder outputs stay in placeholder
order.

That layout makes next-fit over the part's lengths find the same sequences again (``next_fit``;
the loader reports them as ``sequences``): a sample of a later sequence did not fit into any
earlier one when it was placed, so it does not fit into an earlier sequence's final content
either. The language ranks' batch is the part's samples back to back (megatron-core's THD
format, ``cu_seqlens`` at sample boundaries); attention stays inside each sample
(``mimo_train.mcore.attention``).

First-fit-decreasing is hand-written because it must be vectorized over every part of an epoch
(its loop runs ``micro_batch_size`` times per epoch, not per sample); no library here does a
batched bin packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class PackingError(ValueError):
    """Samples that cannot be packed as asked."""


@dataclass(frozen=True)
class Packing:
    """What a packing plan depends on: samples per part and the sequence capacity."""
    part_size: int          # samples a language DP rank gets per micro-batch
    capacity: int           # tokens per packed sequence (seq_length)


def pack_parts(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """``(within, sequences)`` for ``lengths [parts, part_size]``: ``within[p]`` orders part
    ``p``'s samples so its packed sequences are contiguous; ``sequences[p]`` counts them."""
    lengths = np.asarray(lengths, dtype=np.int64)
    parts, size = lengths.shape
    if lengths.size and (lengths.max() > capacity or lengths.min() < 1):
        raise PackingError(f"sample lengths {lengths.min()}..{lengths.max()} do not fit "
                           f"sequences of {capacity} tokens: every sample must have 1.."
                           f"{capacity} tokens (preprocessing truncates to seq_length)")
    rows = np.arange(parts)
    largest_first = np.argsort(-lengths, axis=1, kind="stable")
    loads = np.zeros((parts, size), dtype=np.int64)
    sequence_of = np.empty((parts, size), dtype=np.int64)
    for k in range(size):
        sample = largest_first[:, k]
        length = lengths[rows, sample]
        # the first sequence with room; at turn k at most k are open, so sequence k is empty
        # and always fits: argmax finds an open one or opens the next
        first = (loads + length[:, None] <= capacity).argmax(axis=1)
        loads[rows, first] += length
        sequence_of[rows, sample] = first
    place = np.broadcast_to(np.arange(size), (parts, size))
    within = np.lexsort((place, sequence_of), axis=1)
    return within, np.count_nonzero(loads, axis=1)


def pack_order(lengths: np.ndarray, packing: Packing) -> np.ndarray:
    """Indices that reorder ``lengths`` (an epoch's samples, whole parts) part by part into
    packed order."""
    size = packing.part_size
    if len(lengths) % size:
        raise PackingError(f"{len(lengths)} samples do not cut into parts of {size}")
    within, _ = pack_parts(np.asarray(lengths).reshape(-1, size), packing.capacity)
    return (within + (np.arange(len(within)) * size)[:, None]).reshape(-1)


def next_fit(lengths, capacity: int) -> list[int]:
    """Samples per sequence when ``lengths`` are cut, in order, into sequences of at most
    ``capacity`` tokens (a new one whenever the next sample does not fit)."""
    counts: list[int] = []
    load = capacity + 1
    for length in lengths:
        if load + length > capacity:
            counts.append(0)
            load = 0
        counts[-1] += 1
        load += length
    return counts
