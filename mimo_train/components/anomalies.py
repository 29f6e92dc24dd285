"""Steps whose loss or gradients go wrong, traced to their samples.

- Non-finite: a step whose gradient norm (or loss) is not finite moves no weight (the
  optimizer's step skips its update on the device: ``mcore.optimizer_step``); the trainer
  counts it as skipped here when it reads the step's outcome, and past
  ``train.max_skipped_steps`` the run stops (``Watch.over_limit``).
- Spikes: a step whose loss is above ``train.spike_factor`` times the median loss of the
  ``train.spike_window`` steps before it (0: off), once half that window is seen. Checked when
  the metrics read the losses (each logging step), so no step waits for the device.

Each such step gets a record ``{"step", "anomaly": {"reason", "skipped", "loss",
"grad_norm", "skipped_steps", "samples"}}`` with every sample of its global batch: dataset
directory, key (for ``mimo-inspect sample DIR --key KEY``), tokens, trained tokens and media
token counts, gathered over the control group from one rank of each language DP part
(``reports_samples``: its tensor, context and pipeline peers read the same samples), so a
sample a step holds twice (a small dataset up-sampled by ``data.weights``) is listed twice
(only for such a step: every rank decides alike from world values).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from mimo_data.errors import listed
from mimo_data.loading.layout import LANGUAGE, RankRole
from mimo_train.runtime import distributed


class Watch:
    """Counts skipped steps and finds spikes; each returns the anomaly record to log
    (collective)."""

    def __init__(self, max_skipped: int, spike_factor: float, spike_window: int):
        self.max_skipped, self.spike_factor = max_skipped, spike_factor
        self.recent: deque[float] = deque(maxlen=spike_window)
        self.skipped: set[int] = set()

    def skip(self, step: int, reason: str, grad_norm: float, samples: list[dict]) -> dict:
        """The record of skipped ``step`` (``samples``: this rank's)."""
        self.skipped.add(step)
        return _record(step, reason, True, math.nan, grad_norm, len(self.skipped), samples)

    def spikes(self, records: list[dict], samples: dict[int, list[dict]]) -> list[dict]:
        """The spike records of the train ``records`` just read (``samples``: this rank's
        samples by step)."""
        found = []
        for record in records:
            step, loss = record["step"], record["loss"]
            if step in self.skipped or not math.isfinite(loss):
                continue
            window = self.recent
            if self.spike_factor and 2 * len(window) >= (window.maxlen or 1):
                median = statistics.median(window)
                if loss > self.spike_factor * median:
                    reason = (f"loss spike: {loss:.4f} > {self.spike_factor} x the median "
                              f"{median:.4f} of the {len(window)} steps before")
                    found.append(_record(step, reason, False, loss, record["grad_norm"],
                                         len(self.skipped), samples.get(step, [])))
            window.append(loss)
        return found

    def over_limit(self) -> str | None:
        """Why the run must stop (more skipped steps than allowed), or None."""
        if len(self.skipped) > self.max_skipped:
            weights = _weights_advice(sorted(self.skipped))
            return (
                f"{len(self.skipped)} steps were skipped for a non-finite gradient norm (or "
                f"loss), more than train.max_skipped_steps ({self.max_skipped}): the run stops "
                "(this stop saves no checkpoint). Their samples are in the records' anomaly "
                "entries (mimo-inspect sample DIR --key KEY shows one). Broken samples: mend "
                f"or drop them and resume from the last checkpoint. {weights}. Or raise the "
                "limit")
        return None


def _weights_advice(skipped: list[int]) -> str:
    """What to do where the weights went wrong, for the (sorted) ``skipped`` steps: where
    they run on from their first F (every update since F-1's skipped), a checkpoint saved at
    F-1 or later holds the weights they began from, which an update up to F-1 made."""
    first = skipped[0]
    if skipped[-1] - first + 1 != len(skipped):         # updates between them: no such claim
        return ("Weights gone wrong (a learning rate too high: the loss rising before the "
                f"skips, steps {listed(skipped[:6])}{' ...' if len(skipped) > 6 else ''}): "
                "lower optimizer.lr and resume from a checkpoint saved before it rose "
                "(mimo-inspect checkpoint DIR --all lists them), or start the run again")
    if first == 1:
        return "The first step was skipped: look at the pretrained weights too"
    if first == 2:
        return ("Weights gone wrong (a learning rate too high): step 1's update made the "
                "weights every later step was skipped from, which every checkpoint of the run "
                "holds, so lower optimizer.lr and start the run again")
    return (f"Weights gone wrong (a learning rate too high; the loss rising before step "
            f"{first}, the first skipped): a checkpoint saved at step {first - 1} or later holds "
            "the weights the skips began from (a skipped step updates none), so lower "
            f"optimizer.lr and resume from one saved before step {first - 1} (mimo-inspect "
            "checkpoint DIR --all lists them), or start the run again")


def _record(step: int, reason: str, skipped: bool, loss: float, grad_norm: float,
            skipped_steps: int, samples: list[dict]) -> dict:
    """An anomaly record with the step's ``samples`` of every rank that reports them
    (``reports_samples``; the others give none) in rank order (collective)."""
    every = [s for part in distributed.gather(samples) for s in part]
    return {"step": step, "anomaly": {
        "reason": reason, "skipped": skipped, "loss": loss, "grad_norm": float(grad_norm),
        "skipped_steps": skipped_steps, "samples": every}}


def reports_samples(role: RankRole) -> bool:
    """Whether the samples ``role``'s rank reads are the ones its language DP part's records
    name: the part's first rank (tensor, context and pipeline rank 0) where it reads text."""
    language = next((m for m in role.modules if m.name == LANGUAGE), None)
    return bool(role.text_keys) and language is not None and \
        language.tp_rank == language.cp_rank == language.pp_rank == 0


def step_samples(metadata: dict, datasets: list[str]) -> list[dict]:
    """The samples of one micro-batch's text (``RankLoader`` metadata), for anomaly records;
    empty on ranks without text."""
    samples = []
    counts = metadata.get("token_counts", {})
    for i, key in enumerate(metadata.get("keys", ())):
        dataset, _, name = key.partition("/")
        samples.append({"dataset": datasets[int(dataset)], "key": name,
                        "tokens": int(metadata["tokens"][i]),
                        "trained_tokens": int(metadata["trained_tokens"][i]),
                        "token_counts": {m: [int(c) for c in rows[i]]
                                         for m, rows in counts.items()}})
    return samples
