"""Which samples preprocessing keeps, decided once per dataset from metadata alone.

Every rank must agree on the drops (too long, no trained tokens, ...) without communicating,
or modules would see different global micro-batches. The metadata-only Preprocessor is
deterministic and decodes no media, so every rank computes the same mask over the whole
dataset up front (in memory, a bit per sample). The global order skips dropped samples; a drop
that only full (media-decoding) preprocessing can see is an error at load time, never a skip
(see loader.py).
"""

from __future__ import annotations

import numpy as np
import torch.utils.data
from tqdm import tqdm

from mimo_data.preprocess.preprocessor import Preprocessor, SampleDropped
from mimo_data.tally import Tally
from mimo_data.shards.reader import ShardReader

CHUNK = 256   # samples per worker task


class _Chunks(torch.utils.data.Dataset):
    """Chunk i: ``(start, kept mask, [(reason, key, detail)])`` of samples ``i*CHUNK ...``."""

    def __init__(self, reader: ShardReader, preprocessor: Preprocessor):
        self.reader = reader
        self.preprocessor = preprocessor

    def __len__(self) -> int:
        return -(-len(self.reader) // CHUNK)

    def __getitem__(self, index: int):
        start = index * CHUNK
        stop = min(start + CHUNK, len(self.reader))
        kept = np.ones(stop - start, dtype=bool)
        drops = []
        records = [self.reader.record(position) for position in range(start, stop)]
        for offset, text in enumerate(self.preprocessor.text_batch(records)):
            if isinstance(text, SampleDropped):
                kept[offset] = False
                drops.append((text.reason, records[offset]["key"], text.detail))
        return start, kept, drops


def _as_is(item):
    return item


def kept_mask(reader: ShardReader, preprocessor: Preprocessor, tally: Tally,
              num_workers: int = 0, progress: bool = False) -> np.ndarray:
    """Bool mask of the samples ``preprocessor`` (metadata-only) keeps; drops go to ``tally``
    by reason with the dataset directory and sample key."""
    if preprocessor.with_media:
        raise ValueError("drop decisions must come from a metadata-only Preprocessor "
                         "(with_media=False), which every rank can run")
    mask = np.zeros(len(reader), dtype=bool)
    chunks = torch.utils.data.DataLoader(_Chunks(reader, preprocessor), batch_size=None,
                                         num_workers=num_workers, collate_fn=_as_is)
    for start, kept, drops in tqdm(chunks, desc=f"drops {reader.directory}", unit="chunk",
                                   disable=not progress):
        mask[start:start + len(kept)] = kept
        for reason, key, detail in drops:
            tally.skip(reason, f"{reader.directory}:{key}", detail)
        tally.keep(int(kept.sum()))
    return mask
