"""The deterministic global sample order: a pure function of the datasets' shapes (shard sizes,
kept samples), blend weights, seed and epoch. Pure numpy, identical on every rank, no
communication (docs/architecture.md, "Which rank gets what").

Per dataset and dataset-epoch, reads stay mostly sequential:

1. every shard is cut into blocks of ``block_size`` consecutive samples (byte-contiguous in
   the tar); the blocks of all shards are shuffled together (which shuffles shards too);
2. consecutive runs of ``window_blocks`` blocks in that order form a window, and the samples
   of a window are shuffled together: a reader has at most ``window_blocks`` regions open at
   once, each a contiguous stretch of its shard (its samples in the window's shuffled order);
3. samples that preprocessing drops (the kept mask) are removed.

Blends: an epoch holds ``L = sum of kept samples of all datasets`` samples (with weights, of
the datasets of a positive weight: one of weight 0 is left out, and sizes no epoch). Without weights
each dataset contributes all its kept samples once (exactly once, interleaved). With
weights, dataset i contributes ``n_i`` = its weight's share of L (largest remainder), read from
its own endless stream of dataset-epochs: a dataset with fewer kept samples than n_i repeats
(with a fresh order each pass), one with more continues where the previous epoch stopped, so no
sample repeats before all were seen, but for those of its n_i that ``remainder="drop"`` leaves
out of the epoch's last step: that pass skips them. The n_i samples of each dataset are
spread evenly through the epoch (dataset i's j-th sample at time (j + phase_i) / n_i, phase
seeded), so every stretch of the epoch has the blend's proportions.

Steps: ``floor(L / global_batch)`` per epoch with ``remainder="drop"`` (the last ``L mod B``
samples are dropped, counted in ``remainder_samples``) or ``ceil(L / B)`` with ``"wrap"`` (the
last step is completed with the epoch's first samples, counted likewise). Step s, global
micro-batch m covers epoch positions ``s*B + m*G ... s*B + (m+1)*G`` (G the global
micro-batch size); a module with DP size d gives DP rank r the contiguous part r of d.

Balance (``balance.py``): with an ``Arrangement``, each step's samples are then reordered
within the step so that every module's DP ranks get near-equal tokens; which samples a step
holds does not change. Packing (``packing.py``): with a ``Packing``, each language DP rank's
part of each micro-batch is then reordered so that its packed sequences are contiguous; which
samples a micro-batch holds does not change.

Random keys come from a hand-written splitmix64 hash rather than numpy's Generator, whose
streams may change between numpy versions: a checkpoint must resume to the same order after
an upgrade.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mimo_data.loading.balance import Arrangement, arrange
from mimo_data.loading.packing import Packing, pack_order

_MASK64 = (1 << 64) - 1
_BLOCKS, _SAMPLES, _PHASE = 1, 2, 3     # hash domains


class OrderError(ValueError):
    """Datasets, weights or batch sizes that give no usable order; says what to change."""


class TooFewSamples(OrderError):
    """Fewer kept samples in an epoch than one global batch."""


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on a uint64 array, in place (wrapping arithmetic; one more array
    of its size meanwhile: an epoch's order is computed by every rank and loader worker)."""
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        shifted = z >> np.uint64(30)
        z ^= shifted
        z *= np.uint64(0xBF58476D1CE4E5B9)
        np.right_shift(z, np.uint64(27), out=shifted)
        z ^= shifted
        z *= np.uint64(0x94D049BB133111EB)
        np.right_shift(z, np.uint64(31), out=shifted)
        z ^= shifted
        return z


def _salt(*tags: int) -> np.ndarray:
    """The uint64 that ``tags`` mix into keys."""
    salt = np.zeros(1, dtype=np.uint64)
    for tag in tags:
        salt = _splitmix64(salt ^ np.uint64(tag & _MASK64))
    return salt


def hash_keys(values: np.ndarray, *tags: int) -> np.ndarray:
    """Pseudo-random uint64 keys of ``values`` (non-negative ints) under ``tags``."""
    return _splitmix64(np.asarray(values, dtype=np.uint64) ^ _salt(*tags))


@dataclass(frozen=True)
class DatasetShape:
    """What the order needs of one dataset: samples per shard (write order) and the kept mask."""
    shard_sizes: tuple[int, ...]
    kept: np.ndarray                   # bool, one per sample in write order

    @property
    def kept_count(self) -> int:
        return int(self.kept.sum())


def micro_batch_slice(step: int, micro_batch: int, global_batch_size: int,
                      global_micro_batch_size: int, dp_size: int = 1, dp_rank: int = 0) -> slice:
    """Epoch positions of DP rank ``dp_rank``'s part of global micro-batch ``micro_batch`` of
    ``step``: the contiguous part ``dp_rank`` of ``dp_size``."""
    part = global_micro_batch_size // dp_size
    start = step * global_batch_size + micro_batch * global_micro_batch_size + dp_rank * part
    return slice(start, start + part)


class SampleOrder:
    """Epoch orders of (dataset, position) pairs cut into steps of ``global_batch_size``."""

    def __init__(self, datasets: list[DatasetShape], seed: int, global_batch_size: int,
                 weights: list[float] | None = None, remainder: str = "drop",
                 block_size: int = 64, window_blocks: int = 4,
                 arrangement: Arrangement | None = None,
                 costs: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                 packing: Packing | None = None, names: Sequence[str] = ()):
        """``arrangement``: balance each step by ``costs(datasets, positions)``, the
        ``[samples, columns]`` costs of the given samples (``DataSource.costs``; column 0
        the tokens); ``packing``: then pack each language DP rank's part by its tokens;
        ``names``: the datasets' as errors name them."""
        if (arrangement is None and packing is None) != (costs is None):
            raise OrderError("balancing and packing need the samples' costs, and only they")
        if packing is not None and global_batch_size % packing.part_size:
            raise OrderError(f"global batch {global_batch_size} does not cut into packing "
                             f"parts of {packing.part_size}")
        if remainder not in ("drop", "wrap"):
            raise OrderError(f"remainder is {remainder!r}: use drop or wrap")
        if not 0 <= seed <= _MASK64:
            raise OrderError(f"seed {seed} must be in 0..2**64-1")
        if block_size < 1 or window_blocks < 1 or global_batch_size < 1:
            raise OrderError("block_size, window_blocks and global_batch_size must be >= 1")
        self.datasets = list(datasets)
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.remainder = remainder
        self.block_size = block_size
        self.window_blocks = window_blocks
        self.arrangement = arrangement
        self.packing = packing
        self.costs = costs
        kept = [d.kept_count for d in self.datasets]
        fault = None if weights is None else weights_fault(weights, len(kept))
        if fault is not None:
            raise OrderError(fault)
        self.epoch_length = _drawn_from(weights, kept)
        self.quotas = kept if weights is None else _quotas(weights, kept)
        for i, count in enumerate(kept):
            name = names[i] if names else f"dataset {i}"
            if weights is not None and weights[i] > 0 and not count:
                raise OrderError(f"{name} has weight {weights[i]} but preprocessing "
                                 "keeps none of its samples: " + (
                                     "give it weight 0 or fix its data/config"
                                     if len(kept) > 1 else "fix its data/config") +
                                 " (mimo-inspect report says why each was dropped)")
            if weights is None and not count and len(kept) > 1:     # a mix trained without it
                raise OrderError(f"{name}: preprocessing keeps none of its samples "
                                 f"({len(self.datasets[i].kept)} read), so the mix would go "
                                 "without it: drop it from the list or fix its data/config "
                                 "(mimo-inspect report says why each was dropped)")
        # weighted datasets under one sample an epoch: where one rounds to none, all are said
        under = [] if weights is None else [
            i for i, (w, count) in enumerate(zip(weights, kept))
            if w > 0 and count and w * self.epoch_length / sum(weights) < 1]
        if any(not self.quotas[i] for i in under):
            raise OrderError(_never_drawn(under, weights or [], self.epoch_length, names,
                                          all(not self.quotas[i] for i in under)))
        if remainder == "drop":
            self.steps_per_epoch = self.epoch_length // global_batch_size
        else:
            self.steps_per_epoch = -(-self.epoch_length // global_batch_size)
        if not self.steps_per_epoch:
            raise TooFewSamples(f"an epoch holds {self.epoch_length} kept samples, fewer than "
                                f"one global batch of {global_batch_size}: use a smaller global "
                                "batch or more data")
        self.samples_per_epoch = self.steps_per_epoch * global_batch_size
        self.remainder_samples = abs(self.samples_per_epoch - self.epoch_length)
        self._cached: tuple[int, tuple[np.ndarray, np.ndarray]] | None = None

    def __getstate__(self) -> dict:
        # a spawned worker makes the epoch's order itself, not receive it in a pickle
        return {**self.__dict__, "_cached": None}

    def release(self) -> None:
        """Drop the epoch's order made last (a rank whose forked workers hold it)."""
        self._cached = None

    def dataset_order(self, dataset: int, dataset_epoch: int) -> np.ndarray:
        """Kept positions of one dataset in the order of one of its own epochs."""
        shape = self.datasets[dataset]
        sizes = np.asarray(shape.shard_sizes, dtype=np.int64)
        total = int(sizes.sum())
        # each shard cut into blocks of block_size samples (its last one shorter), in write
        # order: a block's sample count, and where each shard's last block is
        blocks_per_shard = -(-sizes // self.block_size)
        num_blocks = int(blocks_per_shard.sum())
        counts = np.full(num_blocks, self.block_size, dtype=np.int64)
        held = sizes > 0
        counts[np.cumsum(blocks_per_shard)[held] - 1] = \
            sizes[held] - (blocks_per_shard[held] - 1) * self.block_size
        tags = (self.seed, dataset, dataset_epoch)
        block_rank = np.empty(num_blocks, dtype=np.int64)
        block_rank[np.argsort(hash_keys(np.arange(num_blocks), *tags, _BLOCKS),
                              kind="stable")] = np.arange(num_blocks)
        # each sample's window (its block's rank // window_blocks), then its key within; made
        # so to hold few arrays of the dataset's size at once (every rank and loader worker
        # computes an epoch's order)
        window_of = np.repeat((block_rank // self.window_blocks).astype(np.int32), counts)
        keys = np.arange(total, dtype=np.uint64)
        keys ^= _salt(*tags, _SAMPLES)             # hash_keys(positions), in place
        order = np.lexsort((_splitmix64(keys), window_of))
        del keys, window_of
        return order[shape.kept[order]]

    def _dataset_stream(self, dataset: int, start: int, count: int) -> np.ndarray:
        """Positions ``start .. start+count`` of a dataset's endless stream of its epochs."""
        kept = self.datasets[dataset].kept_count
        first, last = start // kept, (start + count - 1) // kept
        stream = np.concatenate([self.dataset_order(dataset, e) for e in range(first, last + 1)])
        offset = start - first * kept
        return stream[offset:offset + count]

    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset, position)`` arrays of the ``samples_per_epoch`` samples of ``epoch``."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        active = [i for i, quota in enumerate(self.quotas) if quota]
        datasets = np.concatenate([np.full(self.quotas[i], i, dtype=np.int32) for i in active])
        positions = np.concatenate([self._dataset_stream(i, epoch * self.quotas[i],
                                                         self.quotas[i]) for i in active])
        if len(active) > 1:
            times = np.concatenate([
                (np.arange(self.quotas[i]) + _unit(self.seed, epoch, _PHASE, i)) / self.quotas[i]
                for i in active])
            order = np.lexsort((datasets, times))
            datasets, positions = datasets[order], positions[order]
        if self.remainder == "drop":
            datasets = datasets[:self.samples_per_epoch]
            positions = positions[:self.samples_per_epoch]
        else:
            datasets = np.resize(datasets, self.samples_per_epoch)
            positions = np.resize(positions, self.samples_per_epoch)
        if self.costs is not None:
            costs = self.costs(datasets, positions)
            if self.arrangement is not None:
                steps, batch = self.steps_per_epoch, self.global_batch_size
                within = arrange(costs.reshape(steps, batch, -1), self.arrangement)
                flat = (within + (np.arange(steps) * batch)[:, None]).reshape(-1)
                datasets, positions, costs = datasets[flat], positions[flat], costs[flat]
            if self.packing is not None:
                flat = pack_order(costs[:, 0], self.packing)
                datasets, positions = datasets[flat], positions[flat]
        self._cached = (epoch, (datasets, positions))
        return datasets, positions


def _unit(*tags: int) -> float:
    """A seeded number in [0, 1)."""
    return float(hash_keys(np.zeros(1), *tags)[0] >> np.uint64(11)) / float(1 << 53)


def _never_drawn(unseen: list[int], weights: list[float], length: int,
                 names: Sequence[str], none: bool) -> str:
    """The refusal of the datasets ``unseen`` whose weights' shares of an epoch of ``length``
    samples are under one (``none``: each rounds to none; else some round up to one by the
    remainders), with the least weight that draws one sample of each when all of them take it
    (rounded up to 3 digits)."""
    rest = sum(weights) - sum(weights[i] for i in unseen)
    least = rest / max(length - len(unseen), 1)
    step = 10.0 ** (math.floor(math.log10(least)) - 2)
    shares = "; ".join(f"{names[i] if names else f'dataset {i}'} has weight {weights[i]}, a "
                       f"share of {weights[i] * length / sum(weights):.2f}" for i in unseen)
    one = len(unseen) == 1
    fate = (f"which round{'s' if one else ''} to none: {'it' if one else 'they'} would never "
            "be drawn" if none else "under one sample each: drawn by the rounding alone, or "
            "never")
    return (f"{shares} of an epoch's {length} samples, {fate}. Give "
            f"{'it' if one else 'each'} a weight of at least "
            f"{math.ceil(least / step) * step:.3g} (one sample an epoch), or 0 to leave "
            f"{'it' if one else 'them'} out")


def _drawn_from(weights: list[float] | None, kept: list[int]) -> int:
    """An epoch's samples: the kept samples of every dataset, or with weights of every one
    of a positive weight (weight 0 leaves a dataset out, its samples too)."""
    return sum(kept) if weights is None else sum(c for w, c in zip(weights, kept) if w > 0)


def weights_fault(weights: Sequence[float], datasets: int) -> str | None:
    """What is wrong with blend weights for this many datasets, or None: the one rule the
    training config, the loader and the sample order each enforce."""
    if len(weights) != datasets:
        return f"{len(weights)} blend weights for {datasets} datasets: give one per dataset"
    if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w)
               and w >= 0 for w in weights) or not 0 < sum(weights) < math.inf:
        return (f"blend weights {list(weights)}: each a share of the samples, a finite number "
                ">= 0, and not all 0 (their sum finite too)")
    return None


def _quotas(weights: list[float], kept: list[int]) -> list[int]:
    """Samples per dataset per epoch: each weight's share of the epoch's samples
    (``_drawn_from``), largest remainder."""
    fault = weights_fault(weights, len(kept))
    if fault is not None:
        raise OrderError(fault)
    total = _drawn_from(weights, kept)
    shares = [w * total / sum(weights) for w in weights]
    quotas = [int(s) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (quotas[i] - shares[i], i))
    for i in by_remainder[:total - sum(quotas)]:
        quotas[i] += 1
    return quotas
