"""The per-step work of a dataset for the layout advisor (``mimo-inspect plan --gpus N``): the
samples of a few global steps in the loader's global order, each with its token counts, read
from the token table through the loader's dry run (no media decoded).

The global order of samples (a function of seed and epoch) does not depend on the layout: a
step is a fixed slice of it, and a module with DP size d gives DP rank r the contiguous part r
of each global micro-batch (``balance: none``). So one dry run of a one-rank colocated layout
of the same modules, with micro-batches of ``micro_batch_size``, gives every step's samples in
order; the advisor then splits them for any candidate layout without running the loader again
(``balance: tokens`` reorders within steps, which this ignores). A dataset with fewer kept
samples than one global batch is read over as many epochs as one step needs (the sample
corpus: 69 samples).

A workload (JSON-ready)::

    {"global_batch_size": B, "micro_batch_size": M, "seq_length": S, "packing": bool,
     "epochs": E, "vocab_size": V, "modalities": {modality: module},
     "steps": [[{"tokens": n, "trained": n, "items": {modality: [n, ...]},
                 "grids": {modality: [[t, h, w], ...]}}, ...]]}

``trained``: its trained tokens (the only ones whose logits training makes); ``items``: the
tokens each image / clip / audio item of the sample takes in the sequence (what
the encoder emits, after any patch merging); ``grids``: each item's (t, h, w) token grid where
the loader's metadata has one (``token_grids``), else empty; ``vocab_size``: the tokenizer's
with the modality tokens (what sizes a randomly initialised language model's output layer).
"""

from __future__ import annotations

from mimo_data.loading.dry_run import dry_run
from mimo_data.loading.layout import LANGUAGE, Layout
from mimo_data.loading.loader import DataSource
from mimo_data.preprocess.config import PreprocessConfig

MAX_STEPS = 8           # steps read by default: enough for a mean, fast on a large dataset
MAX_EPOCHS = 64         # a tiny dataset read over this many epochs at most


def reference_layout(config: PreprocessConfig, layout: Layout | None = None) -> Layout:
    """One rank, every module colocated: ``layout``'s modules (and modality map) when given,
    else ``language`` and one encoder per modality of the config, named after it (video served
    by the ``image`` module when the config has both, as Qwen2-VL's tower does)."""
    if layout is not None:
        modules = [m.name for m in layout.modules]
        modalities = dict(layout.modalities)
    else:
        modalities = {}
        for modality in config.modalities:
            modalities[modality] = "image" if modality == "video" and \
                "image" in config.modalities else modality
        modules = [LANGUAGE, *dict.fromkeys(modalities.values())]
    return Layout.from_dict({"modules": {name: {"dp": 1, "rank_offset": 0} for name in modules},
                             "modalities": modalities})


def _sample(mb: dict, i: int) -> dict:
    counts = mb.get("token_counts", {})
    return {"tokens": mb["tokens"][i], "trained": mb["trained_tokens"][i],
            "items": {m: list(per_sample[i]) for m, per_sample in counts.items()},
            "grids": {m: [list(g) if g is not None else None for g in per_sample[i]]
                      for m, per_sample in mb.get("token_grids", {}).items()}}


def workload(source: DataSource, config: PreprocessConfig, global_batch_size: int,
             micro_batch_size: int, *, layout: Layout | None = None, seed: int = 0,
             epoch: int = 0, steps: int = MAX_STEPS, packing: bool = False) -> dict:
    """The first ``steps`` global steps of ``epoch`` (fewer when the epoch has fewer; at least
    one, read over later epochs when one epoch holds less than a global batch)."""
    reference = reference_layout(config, layout)
    order: list[dict] = []
    epochs = 0
    while len(order) < global_batch_size * steps and epochs < MAX_EPOCHS:
        # the micro-batches still wanted, not the epoch's: memory bounded by the steps read
        wanted = -(-(global_batch_size * steps - len(order)) // micro_batch_size)
        run = dry_run(source, config, reference, micro_batch_size, micro_batch_size, seed=seed,
                      epoch=epoch + epochs, steps=wanted)
        epochs += 1
        entry = next(e for e in run["ranks"] if e["steps"] is not None)
        order += [_sample(mb, i) for step in entry["steps"] for mb in step["micro_batches"]
                  for i in range(len(mb["keys"]))]
        if len(order) >= global_batch_size:
            steps = min(steps, len(order) // global_batch_size)
    if len(order) < global_batch_size:
        raise ValueError(f"the dataset's kept samples over {epochs} epochs ({len(order)}) do "
                         f"not fill one global batch of {global_batch_size}")
    return {"global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size,
            "seq_length": config.seq_length, "packing": packing, "epochs": epochs,
            "vocab_size": source.metadata.text.vocab_size,
            "modalities": dict(reference.modalities),
            "steps": [order[s * global_batch_size:(s + 1) * global_batch_size]
                      for s in range(steps)]}
