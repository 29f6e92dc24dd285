"""Token balance: each global batch's samples arranged so that every module's DP ranks get
near-equal work (``data.balance: tokens``).

A step's ``B`` samples fill ``B / G`` global micro-batches of ``G``; a module with DP size
``d`` gives DP rank ``r`` the contiguous part ``r`` of ``d`` of each (``sample_order``). With
``L`` the least common multiple of the DP sizes to balance (modules with DP size 1 need none),
each global micro-batch is cut into ``L`` columns of ``G / L`` samples, and a module's DP rank
``r`` owns columns ``r*L/d ... (r+1)*L/d``. Balancing chooses each sample's column; the step
keeps exactly its samples (exactly-once and resume at step boundaries are unchanged), only
their places within it move.

Costs come from the token table: a sample's tokens for the language module, its media tokens
of the module's modalities for an encoder, each divided by the module's fair share in the step.
Samples go largest first (summed costs) in rounds of ``L``, one per column per round, each to
the free column that adds least to the sum of squared rank loads; then pairs of a round are
swapped between columns while that sum drops (``PASSES`` sweeps). Rounds keep every column at
``B / L`` samples. Round ``t`` fills micro-batch ``t // (G / L)``, so a step's longest samples
land in its first micro-batches: unpacked, micro-batches of similar lengths pad less
(``tools/bench_throughput.py``); the first micro-batches of a step hold the most tokens.
Hand-written because no library here does a vector-cost, equal-cardinality partition; it is
vectorized over the steps of an epoch, so its Python loops run about
``B * PASSES`` times per epoch, not per sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PASSES = 4      # sweeps of pairwise swaps after the greedy rounds
BALANCE = ("none", "tokens")    # the values of data.balance


@dataclass(frozen=True)
class Arrangement:
    """What a balanced arrangement depends on: the global micro-batch size and, per module,
    its DP size and the cost columns it sums (0: language tokens, 1 + k: modality k)."""
    global_micro_batch_size: int
    modules: tuple[tuple[str, int, tuple[int, ...]], ...]     # (name, dp size, columns)

    def __str__(self) -> str:
        return f"tokens, global micro-batch {self.global_micro_batch_size}, " + ", ".join(
            f"{name} dp {dp}" for name, dp, _ in self.modules)


def arrange(costs: np.ndarray, arrangement: Arrangement) -> np.ndarray:
    """``[steps, B]``: for every step, which of its samples (rows of ``costs``, ``[steps, B,
    columns]``) goes to each position of the step."""
    steps, batch, _ = costs.shape
    every = np.arange(steps)
    modules = [(dp, columns) for _, dp, columns in arrangement.modules if dp > 1]
    if not modules:
        return np.broadcast_to(np.arange(batch), (steps, batch)).copy()
    group = arrangement.global_micro_batch_size
    width = math.lcm(*(dp for dp, _ in modules))           # columns per global micro-batch
    per_column = group // width
    rounds = batch // width
    work = np.stack([costs[:, :, list(columns)].sum(axis=2) for _, columns in modules],
                    axis=2).astype(np.float64)                                   # [S, B, M]
    fair = work.sum(axis=1) / np.array([dp for dp, _ in modules])                 # [S, M]
    work /= np.where(fair > 0, fair, np.inf)[:, None, :]     # a DP rank's fair share is 1
    rank_of = [np.arange(width) // (width // dp) for dp, _ in modules]
    loads = [np.zeros((steps, dp)) for dp, _ in modules]
    member = np.empty((steps, rounds, width), dtype=np.int64)   # sample at (round, column)
    order = np.argsort(-work.sum(axis=2), axis=1, kind="stable")
    for turn in range(rounds):
        taken = np.zeros((steps, width), dtype=bool)
        for k in range(width):
            sample = order[:, turn * width + k]
            cost = work[every, sample]                                           # [S, M]
            # growth of the sum of squared loads, less the cost's own square (the same
            # in every column)
            growth = np.zeros((steps, width))
            for m, ranks in enumerate(rank_of):
                growth += 2 * loads[m][:, ranks] * cost[:, m:m + 1]
            growth[taken] = np.inf
            column = growth.argmin(axis=1)
            taken[every, column] = True
            member[every, turn, column] = sample
            for m, ranks in enumerate(rank_of):
                loads[m][every, ranks[column]] += cost[:, m]
    first, second = np.triu_indices(width, 1)
    for _ in range(PASSES):
        for turn in range(rounds):
            change = np.zeros((steps, len(first)))
            for m, ranks in enumerate(rank_of):
                a, b = loads[m][:, ranks[first]], loads[m][:, ranks[second]]
                moved = (work[every[:, None], member[:, turn, second], m]
                         - work[every[:, None], member[:, turn, first], m])
                swapped = (a + moved) ** 2 + (b - moved) ** 2 - a ** 2 - b ** 2
                change += np.where(ranks[first] == ranks[second], 0.0, swapped)
            best = change.argmin(axis=1)
            better = change[every, best] < -1e-12
            at, one, other = every[better], first[best[better]], second[best[better]]
            if not len(at):
                continue
            a_sample, b_sample = member[at, turn, one], member[at, turn, other]
            for m, ranks in enumerate(rank_of):
                moved = work[at, b_sample, m] - work[at, a_sample, m]
                np.add.at(loads[m], (at, ranks[one]), moved)
                np.add.at(loads[m], (at, ranks[other]), -moved)
            member[at, turn, one], member[at, turn, other] = b_sample, a_sample
    # round t, column c -> micro-batch t // per_column, place c * per_column + t % per_column
    turns, columns = np.arange(rounds)[:, None], np.arange(width)[None, :]
    position = (turns // per_column) * group + columns * per_column + turns % per_column
    arranged = np.empty((steps, batch), dtype=np.int64)
    arranged[:, position.reshape(-1)] = member.reshape(steps, -1)
    return arranged
