"""The token table of one dataset under one preprocessing config: for every sample, kept or
why it is dropped, its tokens, its trained tokens and each media item's token count.

Every rank must agree on the drops (too long, no trained tokens, ...) without communicating,
or modules would see different global micro-batches. The metadata-only Preprocessor is
deterministic and decodes no media, so the table is a pure function of the dataset and the
preprocessing; it is computed once (in DataLoader worker processes, and split over the ranks of
a job when a ``Partition`` is given) and saved beside the dataset (``shards/cache.py``), keyed
by everything it depends on: the dataset's index, the preprocessing config, the tokenizer's
files, the chat template and the source of the code that computes it. A table whose key does
not match, or that is truncated or altered, is never used: it is computed again.

A drop that only full (media-decoding) preprocessing can see is an error at load time, never a
skip (see loader.py).

Columns: ``drop`` (int8: 0 kept, else 1 + index into ``mimo.reasons``), ``detail`` (string,
why it was dropped; null when kept), ``kind`` (int8: the record's kind, an index into
``RECORD_KINDS``; -1 for a kind that is none of them), ``tokens`` and ``trained`` (int32; 0
when dropped), and per modality ``tokens_<modality>`` (list of int32: token count per item, in
item order).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch.utils.data
from tqdm import tqdm

import mimo_data
from mimo_data.preprocess.preprocessor import TEXT_BATCH, Preprocessor, SampleDropped
from mimo_data.shards import cache
from mimo_data.shards.reader import ShardReader
from mimo_data.shards.format import RECORD_KINDS
from mimo_data.shards.sample_table import build_digest
from mimo_data.tally import FIRST_LOCATIONS, Tally

CHUNK = 4 * TEXT_BATCH   # samples per worker task: fewer hand-overs than one text batch
# The code whose output the table is: a change to any of these files makes a new key.
CODE = sorted([*Path(mimo_data.__file__).parent.glob("preprocess/*.py"),
               *Path(mimo_data.__file__).parent.glob("modalities/**/*.py"),
               Path(mimo_data.__file__).parent / "shards" / "records.py", Path(__file__)])
# Libraries whose behaviour the table depends on (tokenization, template rendering).
LIBRARIES = ("transformers", "tokenizers", "jinja2")


class TableError(RuntimeError):
    """A token table could not be made on some rank(s) of a job; the same on every rank.
    ``gathered_failures``: each error (its type and message) with the ranks it happened on."""

    def __init__(self, failures: dict[str, list[int]]):
        super().__init__("; ".join(
            f"rank {ranks[0]}: {error}" if len(ranks) == 1 else
            f"ranks {', '.join(map(str, ranks))}: {error}" for error, ranks in failures.items()))
        self.gathered_failures = failures


@dataclass(frozen=True)
class Partition:
    """This process's share of computing a table across a job: it computes every
    ``world``-th chunk from ``rank`` and ``gather`` (an all-gather of Python objects over every
    rank) combines the parts; ``writes``: this process saves the table (one per machine)."""
    rank: int
    world: int
    gather: Callable[[Any], list[Any]]
    writes: bool

    def together(self, function: Callable[[], Any], gather: bool = False) -> Any:
        """``function()`` on every rank; its result here, or every rank's (``gather``). If it
        raised anywhere, TableError on every rank naming the ranks, so that none is left
        waiting in a later gather."""
        try:
            result, error = function(), None
        except Exception as exc:            # reported on every rank just below
            result, error = None, f"{type(exc).__name__}: {exc}"
        gathered = self.gather((result if gather else None, error))
        failed: dict[str, list[int]] = {}          # each error once, with its ranks
        for rank, (_, error) in enumerate(gathered):
            if error:
                failed.setdefault(error, []).append(rank)
        if failed:
            raise TableError(failed)
        return [result for result, _ in gathered] if gather else result


class TokenTable:
    """Numpy views of a token table (memory-mapped when read from its file ``path``)."""

    def __init__(self, table: pa.Table, modalities: Sequence[str], path: str | None = None):
        self.path = path
        self.modalities = list(modalities)
        self.reasons: list[str] = json.loads(table.schema.metadata[b"mimo.reasons"])
        self.drop = cache.column(table, "drop").to_numpy()
        self.kept = self.drop == 0
        self.details = cache.column(table, "detail")
        self.kinds = cache.column(table, "kind").to_numpy()
        self.tokens = cache.column(table, "tokens").to_numpy()
        self.trained = cache.column(table, "trained").to_numpy()
        self.item_tokens: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for modality in modalities:
            column = cache.column(table, f"tokens_{modality}")
            self.item_tokens[modality] = (column.offsets.to_numpy(),
                                          column.values.to_numpy())

    def __reduce__(self):
        # A spawned DataLoader worker maps the file again instead of receiving a copy.
        if self.path is None:
            return super().__reduce__()
        return _mapped, (self.path, self.modalities)

    def __len__(self) -> int:
        return len(self.drop)

    def items(self, modality: str) -> np.ndarray:
        """Number of ``modality`` items per sample."""
        return np.diff(self.item_tokens[modality][0])

    def tally(self, tally: Tally, directory: str, keys) -> None:
        """Add the table's kept and dropped samples to ``tally`` (drops by reason, the first
        ones with their dataset directory, sample key and detail)."""
        tally.keep(int(self.kept.sum()))
        for code, reason in enumerate(self.reasons, start=1):
            dropped = np.flatnonzero(self.drop == code)
            if len(dropped):
                tally.skip_many(reason, len(dropped), [
                    (f"{directory}:{keys[int(p)].as_py()}", self.details[int(p)].as_py())
                    for p in dropped[:FIRST_LOCATIONS]])


def preprocessing_digest(preprocessor: Preprocessor) -> str:
    """What a token table is computed for, besides the dataset and the code: the preprocessing
    settings, the tokenizer and its chat template."""
    config = preprocessor.config
    digest = hashlib.sha256()
    settings = {k: v for k, v in config.to_dict().items() if k not in ("tokenizer",
                                                                     "chat_template")}
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(_tokenizer_digest(config.tokenizer, preprocessor))
    digest.update(json.dumps(getattr(preprocessor.text, "template", None)).encode())
    return digest.hexdigest()


def table_labels(reader: ShardReader, preprocessor: Preprocessor,
                 kind: str = "tokens") -> cache.Labels:
    """The labels of a table derived from ``reader`` under ``preprocessor``."""
    config = preprocessor.config
    return cache.Labels(kind, build_digest(reader.index, reader.directory),
                        preprocessing_digest(preprocessor),
                        f"tokenizer {config.tokenizer}, seq_length {config.seq_length}")


def table_key(reader: ShardReader, preprocessor: Preprocessor) -> str:
    """Everything the table of ``reader`` under ``preprocessor`` depends on, hashed."""
    digest = hashlib.sha256()
    digest.update(reader.index_digest)
    digest.update(preprocessing_digest(preprocessor).encode())
    for path in CODE:
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(json.dumps({name: importlib.metadata.version(name)
                              for name in LIBRARIES}).encode())
    return digest.hexdigest()


def _tokenizer_digest(tokenizer: str, preprocessor: Preprocessor) -> bytes:
    """The tokenizer directory's files; for a hub name, the loaded tokenizer's definition."""
    digest = hashlib.sha256()
    tokenizer = os.path.expanduser(tokenizer)
    if os.path.isdir(tokenizer):
        for name in sorted(os.listdir(tokenizer)):
            path = os.path.join(tokenizer, name)
            if os.path.isfile(path):
                with open(path, "rb") as data:
                    digest.update(name.encode() + hashlib.file_digest(data, "sha256").digest())
    else:
        loaded = preprocessor.text.tokenizer
        digest.update(loaded.backend_tokenizer.to_str().encode())
        digest.update(json.dumps(loaded.init_kwargs, sort_keys=True, default=str).encode())
    return digest.digest()


class Rows:
    """Rows of a token table in sample order, from ``start``: what one worker task or a
    ``mimo-inspect report`` pass gathers; ``assemble`` makes the table of all of them. The
    columns are ``array``s (4 bytes a value, 1 a kind): a whole dataset's report holds them
    all, and a list holds an 8-byte pointer and a 28-byte int object a value."""

    def __init__(self, modalities: Sequence[str], start: int = 0):
        self.start = start
        self.tokens = array("i")
        self.trained = array("i")
        self.kinds = array("b")
        self.items = {m: array("i") for m in modalities}
        self.item_tokens = {m: array("i") for m in modalities}
        self.drops: dict[int, tuple[str, str]] = {}     # position -> (reason, detail)

    def add(self, dropped: str | None, detail: str, tokens: int, trained: int,
            token_counts: dict[str, list[int]], kind: object) -> None:
        """The next sample: ``dropped`` its drop reason (None: kept); ``kind`` its record's."""
        self.kinds.append(RECORD_KINDS.index(kind) if kind in RECORD_KINDS else -1)
        if dropped is not None:
            self.drops[self.start + len(self.tokens)] = (dropped, detail)
            tokens, trained, token_counts = 0, 0, {}
        self.tokens.append(tokens)
        self.trained.append(trained)
        for modality, counts in self.items.items():
            counts.append(len(token_counts.get(modality, ())))
            self.item_tokens[modality].extend(token_counts.get(modality, ()))

    def arrays(self) -> dict:
        """Compact numpy columns (what a worker sends back)."""
        return {"start": self.start, "tokens": _numpy(self.tokens, np.int32),
                "trained": _numpy(self.trained, np.int32), "drops": self.drops,
                "kinds": _numpy(self.kinds, np.int8),
                "items": {m: _numpy(c, np.int32) for m, c in self.items.items()},
                "item_tokens": {m: _numpy(c, np.int32) for m, c in self.item_tokens.items()}}


def _numpy(column: array, dtype) -> np.ndarray:
    """A copy of ``column`` as numpy (``array``'s ``i`` is a C int: 32 bits where mimo runs)."""
    return np.frombuffer(column, dtype=np.dtype(column.typecode)).astype(dtype)


def assemble(parts: list[dict], modalities: Sequence[str]) -> pa.Table:
    """The token table of ``Rows.arrays()`` parts covering samples 0... without a gap."""
    parts = sorted(parts, key=lambda part: part["start"])

    def joined(name: str, modality: str | None = None) -> np.ndarray:
        arrays = [part[name] if modality is None else part[name][modality] for part in parts]
        return np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
    drops = sorted((p, d) for part in parts for p, d in part["drops"].items())
    reasons = sorted({reason for _, (reason, _) in drops})
    tokens = joined("tokens")
    drop = np.zeros(len(tokens), np.int8)
    # detail: null for kept samples, taken from the drops' own details (no object per sample)
    which = np.zeros(len(tokens), np.int64)
    for n, (position, (reason, _)) in enumerate(drops, start=1):
        drop[position], which[position] = reasons.index(reason) + 1, n
    details = pa.array([None] + [detail for _, (_, detail) in drops], pa.string())
    table: dict[str, Any] = {"drop": drop, "detail": details.take(pa.array(which)),
                             "kind": joined("kinds").astype(np.int8),
                             "tokens": tokens, "trained": joined("trained")}
    for modality in modalities:
        offsets = np.concatenate([[0], np.cumsum(joined("items", modality), dtype=np.int64)])
        table[f"tokens_{modality}"] = pa.LargeListArray.from_arrays(
            offsets, joined("item_tokens", modality))
    return pa.table(table).replace_schema_metadata({b"mimo.reasons":
                                                    json.dumps(reasons).encode()})


class _Chunks(torch.utils.data.Dataset):
    """Chunk ``chunks[i]``: ``Rows.arrays()`` of samples ``chunk * CHUNK ...``."""

    def __init__(self, reader: ShardReader, preprocessor: Preprocessor, chunks: Sequence[int]):
        self.reader = reader
        self.preprocessor = preprocessor
        self.chunks = chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> dict:
        start = self.chunks[index] * CHUNK
        stop = min(start + CHUNK, len(self.reader))
        rows = Rows(list(self.preprocessor.config.modalities), start)
        for batch in range(start, stop, TEXT_BATCH):    # the text batch the token cache fits
            records = [self.reader.record(position)
                       for position in range(batch, min(batch + TEXT_BATCH, stop))]
            for record, text in zip(records, self.preprocessor.text_batch(records)):
                kind = record.get("kind", "conversation")
                if isinstance(text, SampleDropped):
                    rows.add(text.reason, text.detail, 0, 0, {}, kind)
                else:
                    rows.add(None, "", len(text.ids) - 1, int(text.loss_mask.sum()),
                             text.token_counts, kind)
        return rows.arrays()


def _as_is(item):
    return item


def compute(reader: ShardReader, preprocessor: Preprocessor, num_workers: int = 0,
            partition: Partition | None = None, progress: bool = False) -> pa.Table:
    """The token table of ``reader`` (this process's share of it combined with the others'
    when ``partition`` is given)."""
    if preprocessor.with_media:
        raise ValueError("token tables come from a metadata-only Preprocessor "
                         "(with_media=False), which every rank can run")
    rank, world = (0, 1) if partition is None else (partition.rank, partition.world)
    chunks = range(rank, -(-len(reader) // CHUNK), world)
    loader = torch.utils.data.DataLoader(_Chunks(reader, preprocessor, chunks),
                                         batch_size=None, num_workers=num_workers,
                                         collate_fn=_as_is)

    def part() -> list:
        return list(tqdm(loader, desc=f"token table {reader.directory}", unit="chunk",
                         disable=not progress, delay=1.0, file=sys.stderr))
    parts = [part()] if partition is None else partition.together(part, gather=True)
    table = assemble([chunk for part in parts for chunk in part],
                     list(preprocessor.config.modalities))
    assert table.num_rows == len(reader), (table.num_rows, len(reader))
    return table


def table_path(reader: ShardReader, key: str, cache_dir: str | None = None) -> str:
    return os.path.join(cache.cache_directory(
        reader.directory, cache_dir, reader.remote.options if reader.remote else None),
        f"tokens-{key[:24]}.arrow")


def token_table(reader: ShardReader, preprocessor: Preprocessor, *,
                cache_dir: str | None = None, num_workers: int = 0,
                partition: Partition | None = None, progress: bool = False) -> TokenTable:
    """The token table of ``reader`` under ``preprocessor``: read from its file when it is
    there, for this key and intact; computed and saved otherwise (a collective when
    ``partition`` is given: every rank of it must call)."""
    here: list = []

    def lookup() -> bool:
        key = table_key(reader, preprocessor)
        path = table_path(reader, key, cache_dir)
        here.extend((key, path, cache.read_table(path, key)))
        return here[2] is not None
    # Ranks decide together: one that found no table (another machine, or a launch that wrote
    # it just now) must not leave the others computing without it.
    found = [lookup()] if partition is None else partition.together(lookup, gather=True)
    key, path, table = here
    if not all(found):
        computed = compute(reader, preprocessor, num_workers, partition, progress)
        labels = table_labels(reader, preprocessor)
        if partition is None:
            table = cache.save_table(path, computed, key, labels)
        else:           # one writer per machine; then every rank maps the file it can see
            writes = partition.writes

            def save() -> None:
                if writes:
                    cache.save_table(path, computed, key, labels)
            partition.together(save)
            table = cache.read_table(path, key)
        if table is None:                   # not saved: from memory
            return TokenTable(computed, list(preprocessor.config.modalities))
    return TokenTable(table, list(preprocessor.config.modalities), path)


def _mapped(path: str, modalities: list[str]) -> TokenTable:
    return TokenTable(cache.mapped(path), modalities, path)
