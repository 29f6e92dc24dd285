"""The layout-aware loader: each rank gets exactly its part of each global micro-batch, in
order, with only the tensors its role needs (docs/architecture.md, "Which rank gets what").

    loader = build_loader(["shards/"], "configs/preprocess.yaml",
                          "language=dp2;image=dp1;audio=dp1",
                          rank, world_size, global_batch_size=32, micro_batch_size=4, seed=1)
    if loader is not None:                  # ranks that need no data get None
        for batch, metadata in loader:      # one epoch of micro-batches, resumable
            ...
        checkpoint["loader"] = loader.state_dict()

Which samples: step s, global micro-batch m is a fixed slice of ``sample_order.SampleOrder``
(a function of seed and epoch); a module with DP size d gives DP rank r the contiguous part r
of d. Language ranks run the metadata-only Preprocessor (never decode media); encoder ranks of
pipeline stage 0 decode their samples and get the encoder inputs plus ``input_ids`` and token
counts. Reads are ``pread`` by byte offset (``ShardReader``); from a dataset at a URL, an
encoder rank's worker plans the media of its next ``PREFETCH_MICRO_BATCHES`` micro-batches at a
time, a plan ahead, so that neighbouring samples share ranged requests.

Balance and packing (``balance.py``, ``packing.py``) only reorder samples within a step or a
micro-batch part, in the order itself, so the rule above holds for every rank. With packing,
language ranks get their part as one packed row (``Collator(packed=True)``); encoder ranks keep
a row per sample.

Split media (``split_media=True``, ``media_split.py``): the k ranks of an encoder module that
fan in to one language rank each read that rank's samples and keep part j of k of their media
(contiguous in placeholder order, token-balanced, a clip cut only between temporal patches),
so that the bridge's concatenation in rank order is the whole micro-batch's rows.

Drops: every rank reads them from the same token table (``token_table.py``, computed from
metadata), so all modules skip the same samples. A sample whose media fails to decode at load
time cannot be skipped (the language ranks keep it): that is a ``LoaderError``, never a silent
desynchronisation.

Workers: a ``torch.utils.data.IterableDataset`` gives the rank's micro-batch i (counted from
where iteration starts) to worker ``i mod W``; ``DataLoader`` returns worker results
round-robin, so the sequence is the same for any W. A worker sends a micro-batch's tensors packed
into one buffer (``tensor_pack``); batches arrive as views of it. The stream runs on across
epochs and the DataLoader iterator lives as long as the loader (workers stay up and prefetch
across epoch ends, what ``persistent_workers`` would give); it restarts only when a state is
loaded. Ranks that decode no media (language ranks) work in-process whatever ``num_workers``:
their micro-batch costs less than handing it over from a worker (``tools/bench_loader.py``).

State: ``state_dict()`` = seed, epoch, position in the epoch (samples, step, micro-batch),
global batch size and the data fingerprint (sha256 of the datasets' index.json, the blend
weights and the kept masks). Positions are in samples of the global order, so a state restores
under any layout, micro batch or worker count with the same global batch size: a state of a
step's end (a checkpoint's) always, one of a step's middle where it stopped at a whole number
of the new global micro-batches.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import signal

from collections.abc import Iterator
from typing import Any, NamedTuple, cast

import numpy as np
import torch.utils.data

from mimo_data.errors import listed
from mimo_data.preprocess.chat_tokens import TextEncoder
from mimo_data.preprocess.collate import Batch, BatchMetadata, Collator
from mimo_data.loading.balance import BALANCE, Arrangement
from mimo_data.loading.packing import Packing, next_fit
from mimo_data.loading.token_table import Partition, TokenTable, token_table
from mimo_data.loading.layout import LANGUAGE, Layout, LayoutError, RankRole
from mimo_data.loading.media_split import Item, Piece, check_split_media, cut, placeholder_order
from mimo_data.preprocess.preprocessor import Preprocessor, Sample, SampleDropped, TextSample
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.tally import Tally
from mimo_data.loading.sample_order import (DatasetShape, SampleOrder, TooFewSamples,
                                             micro_batch_slice, weights_fault)
from mimo_data.modalities import MODALITIES
from mimo_data.shards import storage
from mimo_data.shards.format import INDEX_FILE, ShardRecord, record_origin
from mimo_data.shards.index import remake
from mimo_data.shards.reader import ShardReader
from mimo_data.loading.tensor_pack import pack, unpack

# A worker's micro-batches whose media one prefetch plans (remote datasets): enough samples
# for neighbours in a shard to share a request (``tools/bench_remote.py``).
PREFETCH_MICRO_BATCHES = 8
# Records whose text a stream renders and tokenizes in one ``text_batch``, over its next
# micro-batches: per call, the text path's numpy and tokenizer calls cost about as much for 4
# records as for 32 (``tools/bench_metadata.py``).
TEXT_AHEAD = 64
STATE_FORMAT = "mimo-loader-state"
STATE_VERSION = 1


class LoaderError(RuntimeError):
    """The loader cannot go on without breaking exactly-once or cross-module agreement."""


def variable_token_modalities(config: PreprocessConfig) -> list[str]:
    """Modalities whose token count varies per sample: dynamic-resolution images, audio
    (tokens follow the clip's duration)."""
    return [name for name, modality_config in config.modalities.items()
            if MODALITIES[name].variable_tokens(modality_config)]


class TooManyDropped(ValueError):
    """More of the data's samples dropped by preprocessing than ``data.max_dropped_fraction``."""


def check_dropped(source: DataSource, limit: float, key: str = "data.datasets") -> None:
    """Raise TooManyDropped where preprocessing drops more than ``limit`` of the samples of
    one of ``source``'s datasets (too long, damaged media ...: counted by the token tables
    before any step), each dataset on its own: a blend draws a dataset by its weight, however
    few of its samples are left."""
    for directory, reader, table in zip(source.directories, source.readers, source.tables):
        total = len(table.kept)
        dropped = total - int(table.kept.sum())
        if total and dropped / total > limit:
            tally = Tally("samples", "kept", "dropped")
            table.tally(tally, directory, reader.table.keys)
            raise TooManyDropped(
                f"{key}: preprocessing drops {dropped} of the {total} samples of {directory} "
                f"({dropped / total:.2%}), more than data.max_dropped_fraction {limit:g}: "
                f"{tally.summary()}. mimo-inspect report names them; raise seq_length or the "
                "media budgets, mend the data, or raise the limit")


def check_even_split(source: DataSource, layout: Layout) -> None:
    """Raise LayoutError when an encoder's output must be split evenly but the data's token
    counts per sample differ (the trainer and ``mimo-inspect plan`` check this; the loader
    itself delivers any layout's slices correctly).

    megatron-core 0.19 splits a colocated module's output evenly (``tensor_split``) between
    modules of different DP sizes. That is exact only if every sample has the same token count
    for that modality: a fixed count per item (``Layout.validate`` already refuses
    variable-count modalities there) *and* the same number of items in every kept sample,
    which only the data can tell. Non-colocated bridges route any counts (fan-out by
    megatron-core, fan-in by ``mimo_train.mcore.bridge_routing``).
    """
    language = layout.language
    if not layout.colocated:
        return
    for encoder in layout.encoders:
        if encoder.dp == language.dp:
            continue
        for modality in layout.modalities_of(encoder.name):
            counts = np.concatenate([table.items(modality)[table.kept]
                                     for table in source.tables])
            values, samples = np.unique(counts, return_counts=True)
            if len(values) > 1:
                found = ", ".join(f"{n} sample(s) with {k}" for k, n in zip(values, samples))
                raise LayoutError(
                    f"colocated module {encoder.name!r} (dp {encoder.dp}) feeds {modality} into "
                    f"{LANGUAGE!r} (dp {language.dp}) through an even split, which needs the "
                    f"same number of {modality} items in every sample; the data has {found} "
                    f"{modality} item(s). Give {encoder.name} dp {language.dp}, put the modules "
                    "on separate ranks (non-colocated), or filter the dataset to one count per "
                    "sample")


@dataclasses.dataclass
class _Read:
    """A sample's record and metadata-only text (a drop: why), and its metadata-only Sample
    once made: what ``DataSource.share_texts`` keeps."""
    record: ShardRecord
    text: TextSample | SampleDropped
    sample: Sample | None = None


def given_twice(directories: list[str]) -> tuple[str, str] | None:
    """The first dataset of ``directories`` given twice, and its first spelling (the same
    place named another way: a trailing slash, a link, ``storage.canonical``); None where
    each is given once."""
    seen: dict[str, str] = {}                   # place -> its first spelling
    for directory in directories:
        place = storage.canonical(directory)
        if place in seen:
            return directory, seen[place]
        seen[place] = directory
    return None


def twice_said(directory: str, first: str) -> str:
    """``directory twice``, with the first spelling where it differs."""
    return f"{directory} twice" + (f" (first as {first})" if first != directory else "")


class Copy(NamedTuple):
    """Two datasets of one list that hold the same samples (``held_twice``): which and why,
    the samples held twice, what to do; ``whole``: one dataset copied (weights draw from it
    more often)."""
    which: str
    samples: str
    remedy: str
    whole: bool


def held_twice(indexes: list[tuple[str, bytes, Any]]) -> Copy | None:
    """The first two of ``indexes`` (each a dataset directory, its index.json's sha256 and
    the index parsed) whose index.json are the same bytes (a copy of one dataset, or one
    rebuilt alike), or that hold one shard (the same bytes, by its hash in each index: two
    indexes of the same tars read in place, say), read alike: its samples would be drawn
    twice an epoch, whatever the paths. None where there are none."""
    seen: dict[bytes, str] = {}
    # a shard's sha256 -> how each dataset holding it reads it, the dataset, its name there
    shards: dict[str, list[tuple[str, str, str]]] = {}
    for directory, digest, index in indexes if len(indexes) > 1 else ():
        if digest in seen:
            return Copy(f"{seen[digest]} and {directory}, whose {INDEX_FILE} are the same (a "
                        "copy of one dataset)", "each of its samples", "give it once", True)
        seen[digest] = directory
        held, reading = _shards_of(index)
        for shard in held:
            earlier = shards.setdefault(shard["sha256"], [])
            # the same samples: read alike, or one of them a built dataset's whole samples
            same = [(other, name) for how, other, name in earlier if other != directory
                    and (how == reading or "" in (how, reading))]
            if same:
                other, name = same[0]
                return Copy(f"{other} and {directory}, which both hold shard {name}" + (
                    f" (as {shard['name']} in {directory})" if shard["name"] != name else "")
                    + " (the same bytes: two indexes of the same tars, or a copy)",
                    f"its {shard['samples']} samples", "give each shard in one dataset "
                    "(mimo-shard index takes a list of tars)", False)
            earlier.append((reading, directory, shard["name"]))
    return None


def _shards_of(index: Any) -> tuple[list[dict], str]:
    """An index's shards that hold samples, each with its sha256 (an index of another shape
    is said by the dataset's own opening), and how its samples are read of them: a built
    dataset's tars hold its samples whole (""); an index of tars read in place reads them by
    the members its build records (its layout, which member is what), so that two indexes
    reading one tar otherwise (its short and its long captions) hold other samples."""
    if not isinstance(index, dict):
        return [], ""
    listed = index.get("shards")
    reading = "" if "shard_root" not in index else json.dumps(
        (index.get("build") or {}).get("members"), sort_keys=True)
    return ([shard for shard in listed if isinstance(shard, dict) and shard.get("samples") and
             isinstance(shard.get("sha256"), str) and isinstance(shard.get("name"), str)]
            if isinstance(listed, list) else []), reading


class DataSource:
    """The datasets of a run, opened once per process: readers (memory-mapped sample tables),
    the metadata-only Preprocessor, token tables (kept samples, token counts) with their drop
    tally, and the fingerprint a loader state is checked against.

    ``partition``: compute missing token tables split over the ranks of a job (a collective:
    every rank of it opens the DataSource); ``cache_dir``: where tables go when a dataset
    directory is read-only or remote (``MIMO_CACHE_DIR`` overrides it); ``storage_options``:
    the fsspec options of datasets given as URLs; ``text``: the config's ``TextEncoder`` when
    the caller has one already (building one loads and analyses the tokenizer: seconds)."""

    def __init__(self, directories, preprocess_config, weights=None, num_workers: int = 0,
                 progress: bool = False, cache_dir: str | None = None,
                 partition: Partition | None = None, storage_options: dict | None = None,
                 text: TextEncoder | None = None):
        directories = [directories] if isinstance(directories, (str, os.PathLike)) \
            else list(directories)
        if not directories:
            raise ValueError("no dataset given")
        self.directories = [str(d) for d in directories]
        self.config = (preprocess_config if isinstance(preprocess_config, PreprocessConfig)
                       else PreprocessConfig.from_yaml(str(preprocess_config)))
        fault = None if weights is None else weights_fault(weights, len(self.directories))
        if fault is not None:
            raise ValueError(fault)
        twice = given_twice(self.directories)
        if twice is not None:
            raise ValueError(f"{twice_said(*twice)} given: each of its samples would be drawn "
                             "twice an epoch; "
                             "give it once" + (", with a larger weight to draw from it more "
                                               "often" if weights is not None else
                                               " (to draw from it more often, weights)"))
        self.weights = None if weights is None else [float(w) for w in weights]

        def open_readers() -> tuple[list[ShardReader], Preprocessor]:
            readers = [ShardReader(d, cache_dir, storage_options) for d in self.directories]
            # the shards are checked once: a bucket's by the job's first rank, a local
            # folder's by each machine's first rank (each machine may hold a copy of its own)
            for reader in readers:
                if partition is None or (
                        partition.rank == 0 if reader.shard_remote else partition.writes):
                    reader.check_shards()
            copy = held_twice([(reader.directory, reader.index_digest, reader.index)
                               for reader, weight in zip(readers, self.weights or
                                                         [1.0] * len(readers)) if weight > 0])
            if copy is not None:
                raise ValueError(f"{copy.which} given: {copy.samples} would be drawn twice "
                                 f"an epoch; {copy.remedy}" + (
                                     " (to draw from it more often, weights)" if copy.whole
                                     else ""))
            return readers, Preprocessor(self.config, with_media=False, text=text)
        opened: tuple[list[ShardReader], Preprocessor] = (
            open_readers() if partition is None else partition.together(open_readers))
        self.readers, self.metadata = opened
        self.tally = Tally("samples", "kept", "dropped")
        self.tables: list[TokenTable] = []
        for reader in self.readers:
            table = token_table(reader, self.metadata, cache_dir=cache_dir,
                                num_workers=num_workers, partition=partition,
                                progress=progress)
            table.tally(self.tally, reader.directory, reader.table.keys)
            self.tables.append(table)
        self.shapes = [DatasetShape(reader.table.shard_sizes(), table.kept)
                       for reader, table in zip(self.readers, self.tables)]
        self._orders: dict[tuple, SampleOrder] = {}
        # ``share_texts``: (dataset, position) -> its record and text, the last ``_capacity``
        self._texts: collections.OrderedDict[tuple[int, int], _Read] | None = None
        self._capacity = 0
        # what the fingerprint is of, as a loader state keeps it to say what changed
        self.fingerprinted: dict[str, Any] = {"datasets": [], "weights": None if
                                              self.weights is None else
                                              [w / sum(self.weights) for w in self.weights]}
        for reader, shape in zip(self.readers, self.shapes):
            kept = np.packbits(shape.kept).tobytes()
            self.fingerprinted["datasets"].append({
                "directory": reader.directory, "index": reader.index_digest.hex()[:16],
                "kept": shape.kept_count, "kept_digest": hashlib.sha256(kept).hexdigest()[:16]})
        self.fingerprint = self.blended_fingerprint(self.fingerprinted["weights"])

    def blended_fingerprint(self, shares: list[float] | None) -> str:
        """The fingerprint of these datasets (their indexes and kept samples) blended by
        ``shares`` (their weights' shares; None: unweighted)."""
        digest = hashlib.sha256()
        for reader, shape in zip(self.readers, self.shapes):
            digest.update(reader.index_digest)
            digest.update(np.packbits(shape.kept).tobytes())
        digest.update(json.dumps(shares).encode())
        if shares is not None and 0 in shares:
            # a dataset of weight 0 sized the epoch until 2026-12-06: a state saved then
            # resumes to another order, and is refused as other data
            digest.update(b"weight 0 leaves a dataset out of the epoch")
        return digest.hexdigest()

    def order(self, seed: int, global_batch_size: int, remainder: str = "drop",
              block_size: int = 64, window_blocks: int = 4,
              arrangement: Arrangement | None = None,
              packing: Packing | None = None) -> SampleOrder:
        """The order of these datasets for a run's settings; the loaders of this process
        asking for the same share one (a dry run's ranks: one epoch's arrays, not one a rank),
        kept while this DataSource lives, one a distinct setting."""
        key = (seed, global_batch_size, remainder, block_size, window_blocks, arrangement,
               packing)
        if key in self._orders:
            return self._orders[key]
        needs_costs = arrangement is not None or packing is not None
        try:
            order = SampleOrder(self.shapes, seed, global_batch_size, self.weights, remainder,
                                block_size, window_blocks, arrangement,
                                self.costs if needs_costs else None, packing,
                                names=self.directories)
            self._orders[key] = order
            return order
        except TooFewSamples as error:
            if not self.tally.skipped_total:
                raise
            # too few samples for a batch: say what preprocessing dropped, and where to look
            long = (f"; too_long: longer than seq_length {self.config.seq_length}, raise it"
                    if "too_long" in self.tally.skipped else "")
            if not sum(shape.kept_count for shape in self.shapes):     # the cause, first
                raise TooFewSamples(f"preprocessing keeps none of the samples ("
                                    f"{self.tally.summary()}{long}): mimo-inspect report "
                                    "lists them") from None
            raise TooFewSamples(f"{error}. Preprocessing dropped some ({self.tally.summary()}"
                                f"{long}): mimo-inspect report lists them") from None

    def share_texts(self, capacity: int) -> None:
        """Keep the last ``capacity`` samples' ``texts`` (and ``metadata_sample``) for this
        process's other loaders: a dry run steps every rank's loader in turn over the same
        samples, which are then read, tokenized and made into tensors once, not once a rank
        that reads them and a balance. 0: keep none."""
        self._texts = collections.OrderedDict() if capacity else None
        self._capacity = capacity

    def texts(self, pairs: list[tuple[int, int]]
              ) -> list[tuple[ShardRecord, TextSample | SampleDropped]]:
        """The records of ``(dataset, position)`` pairs (keys prefixed with the dataset's
        number) and their metadata-only text (a drop: why), computed in one ``text_batch``."""
        shared = self._texts
        missing = [pair for pair in pairs if shared is None or pair not in shared]
        records = []
        for dataset, position in missing:
            record = self.readers[dataset].record(position)
            record["key"] = f"{dataset}/{record['key']}"
            records.append(record)
        made = {pair: _Read(record, text) for pair, record, text
                in zip(missing, records, self.metadata.text_batch(records))}
        if shared is not None:
            for pair in pairs:
                if pair not in made:
                    shared.move_to_end(pair)
            shared.update(made)
            made = {pair: shared[pair] for pair in pairs}
            while len(shared) > self._capacity:
                shared.popitem(last=False)
        return [(made[pair].record, made[pair].text) for pair in pairs]

    def metadata_sample(self, pair: tuple[int, int], text: TextSample) -> Sample:
        """The metadata-only Sample of ``pair``'s ``text`` (no encoder inputs), made once while
        ``share_texts`` keeps it."""
        entry = None if self._texts is None else self._texts.get(pair)
        if entry is None or entry.text is not text:
            return self.metadata.sample(text)
        if entry.sample is None:
            entry.sample = self.metadata.sample(text)
        return entry.sample

    def costs(self, datasets: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``[samples, 1 + modalities]``: the given samples' tokens, then their media tokens
        per configured modality (the balance's cost columns)."""
        modalities = list(self.config.modalities)
        costs = np.zeros((len(positions), 1 + len(modalities)), dtype=np.int64)
        for dataset, table in enumerate(self.tables):
            at = datasets == dataset
            chosen = positions[at]
            costs[at, 0] = table.tokens[chosen]
            for column, modality in enumerate(modalities, start=1):
                offsets, values = table.item_tokens[modality]
                running = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
                costs[at, column] = running[offsets[chosen + 1]] - running[offsets[chosen]]
        return costs


def balance_arrangement(layout: Layout, micro_batch_size: int, modalities: list[str],
                        split_media: bool = False) -> Arrangement:
    """The balance of ``layout``: language tokens over its DP ranks, each encoder's media
    tokens (of its modalities) over its DP ranks. With ``split_media``, an encoder module
    that fans in reads its language rank's samples and splits their media among its ranks:
    its media tokens are balanced over the language DP ranks (each one's group of its ranks)."""
    column = {modality: 1 + k for k, modality in enumerate(modalities)}
    modules = [(LANGUAGE, layout.language.dp, (0,))] + [
        (encoder.name, layout.language.dp if split_media and layout.fans_in(encoder)
         else encoder.dp, tuple(column[m] for m in layout.modalities_of(encoder.name)
                                if m in column))
        for encoder in layout.encoders]
    return Arrangement(layout.global_micro_batch_size(micro_batch_size), tuple(modules))


def _as_is(item):
    return item


class _RankStream(torch.utils.data.IterableDataset):
    """This rank's micro-batches from ``start`` on, across epochs, split round-robin over
    DataLoader workers."""

    def __init__(self, source: DataSource, order: SampleOrder, role: RankRole,
                 global_micro_batch_size: int, decode_media: bool, start: tuple[int, int],
                 split: dict[str, tuple[int, int, int, int]] | None = None):
        self.source = source
        self.order = order
        self.role = role
        self.group = global_micro_batch_size
        self.per_step = order.global_batch_size // global_micro_batch_size
        self.per_epoch = order.steps_per_epoch * self.per_step
        self.start = start
        self.dp = {part.name: (part.dp_size, part.dp_rank) for part in role.modules}
        # data.split_media: encoder module -> (language dp size, the language DP rank it fans
        # in to, its ranks per language rank, which of them this rank is); the module reads
        # that language rank's samples and keeps its part of their media (``media_split``)
        self.split = split or {}
        for module, (dp_size, dp_rank, _, _) in self.split.items():
            self.dp[module] = (dp_size, dp_rank)
        self.decode_media = decode_media and bool(role.media)
        # An encoder rank decodes only the modalities of its own encoders.
        self.full = (Preprocessor(source.config, with_media=set(role.media),
                                  text=source.metadata.text) if self.decode_media else None)
        self.collate = Collator(source.metadata)
        # packing shapes the language model's batch; encoder ranks keep a row per sample
        self.packing = order.packing if role.text_module == LANGUAGE else None
        self.collate_text = Collator(source.metadata, packed=True) if self.packing \
            else self.collate
        # (epoch, position in the epoch's order) -> its record and TextSample (or drop), read
        # and computed ahead for this worker's next micro-batches (``_text_ahead``)
        self._ahead: dict[tuple[int, int], tuple[ShardRecord, Any]] = {}
        self._every = 1

    def __iter__(self):
        """``(batch, metadata)`` per micro-batch, the batch packed (``tensor_pack``) when made
        by a worker."""
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        self._every = workers
        epoch, index = self.start
        planned = index              # micro-batches of the epoch before this one are planned
        for count in itertools.count():
            if count % workers == worker:
                if index >= planned - PREFETCH_MICRO_BATCHES * workers:
                    planned = self.prefetch(epoch, max(index, planned), index + 2 *
                                            PREFETCH_MICRO_BATCHES * workers, workers)
                batch, metadata = self.micro_batch(epoch, index)
                yield (batch if info is None else pack(batch)), metadata
            index += 1
            if index == self.per_epoch:
                epoch, index, planned = epoch + 1, 0, 0

    def prefetch(self, epoch: int, start: int, stop: int, every: int) -> int:
        """Start reading, from remote datasets, this rank's media members of micro-batches
        ``start, start + every, ...`` before ``stop`` of ``epoch``, as one plan
        (``ShardReader.prefetch``: the more samples a plan holds, the more of them share a
        request); return where the plan ends. A no-op for ranks that decode nothing."""
        stop = min(stop, self.per_epoch)      # the next epoch's order is not made yet
        if not self.decode_media or start >= stop or \
                not any(reader.remote for reader in self.source.readers):
            return stop
        assert self.full is not None
        datasets, positions = self.order.epoch(epoch)
        chosen = np.unique(np.concatenate([
            np.arange(part.start, part.stop) for number in range(start, stop, every)
            for part in (self._slice(module, *divmod(number, self.per_step))
                         for module in self.role.media.values())]))
        prefixes = tuple(MODALITIES[name].member_prefix for name in self.full.media_modalities)
        for dataset, reader in enumerate(self.source.readers):
            reader.prefetch(positions[chosen[datasets[chosen] == dataset]].tolist(),
                            lambda name: name.startswith(prefixes))
        return stop

    def _slice(self, module: str, step: int, micro: int) -> slice:
        dp_size, dp_rank = self.dp[module]
        return micro_batch_slice(step, micro, self.order.global_batch_size, self.group,
                                 dp_size, dp_rank)

    def _sample(self, datasets, positions, at: int, record: ShardRecord, text,
                full: bool) -> Sample:
        """The sample at ``at`` from its record and TextSample (or drop)."""
        dataset, position = int(datasets[at]), int(positions[at])
        reader = self.source.readers[dataset]
        try:
            if isinstance(text, SampleDropped):
                raise text
            if full:
                assert self.full is not None
                return self.full.sample(text, reader.media(position, record,
                                                           self.full.media_modalities))
            return self.source.metadata_sample((dataset, position), text)
        except SampleDropped as exc:
            raise LoaderError(
                f"{reader.directory}: sample {record['key']} ({record_origin(record)}) is dropped "
                f"at load time ({exc.reason}: {exc.detail}) but the metadata-only pass kept it, "
                "so other modules will train on it; skipping it here would desynchronise the "
                f"modules. Run `mimo-shard verify`, {remake(reader.index)} with `--check "
                "decode` (drops undecodable media when it is made), then restart") from None

    def _token_grids(self, texts) -> dict[str, list[list[list[int] | None]]]:
        """modality -> per sample, the [t, h, w] grid of each item's placeholder tokens (None:
        a sequence), from the metadata (what an encoder's FLOPs depend on); lists, as the
        rest of the metadata, so that it is the same after a JSON round trip (the dry run)."""
        config = self.source.config.modalities
        grids: dict[str, list[list[list[int] | None]]] = {m: [] for m in config}
        for text in texts:
            for rows in grids.values():
                rows.append([])
            for item in text.items:
                name = item["modality"]
                if name in grids:
                    grid = MODALITIES[name].token_grid(item, config[name])
                    grids[name][-1].append(None if grid is None else list(grid))
        return grids

    def _parts(self, index: int) -> tuple[slice, dict[str, slice]]:
        """The text slice and each modality's media slice of micro-batch ``index``."""
        step, micro = divmod(index, self.per_step)
        assert self.role.text_module is not None
        return (self._slice(self.role.text_module, step, micro),
                {modality: self._slice(module, step, micro)
                 for modality, module in self.role.media.items()})

    def _needed(self, index: int) -> list[int]:
        """Positions in the epoch's order whose records micro-batch ``index`` reads."""
        text, media = self._parts(index)
        return sorted({at for part in (text, *media.values())
                       for at in range(part.start, part.stop)})

    def _text_ahead(self, epoch: int, index: int) -> None:
        """Read the records of micro-batch ``index`` and of this worker's next ones in the
        epoch (every ``_every``-th), ``TEXT_AHEAD`` records or more, and compute their text in
        one ``text_batch`` (a drop is the sample's result, used when its micro-batch comes)."""
        datasets, positions = self.order.epoch(epoch)
        self._ahead = {key: value for key, value in self._ahead.items() if key[0] == epoch}
        ats: list[int] = []
        for ahead in range(index, self.per_epoch, self._every):
            ats += [at for at in self._needed(ahead) if (epoch, at) not in self._ahead]
            if len(ats) >= TEXT_AHEAD:
                break
        found = self.source.texts([(int(datasets[at]), int(positions[at])) for at in ats])
        self._ahead.update(((epoch, at), pair) for at, pair in zip(ats, found))

    def _media_pieces(self, texts: dict[int, Any], media: dict[str, slice]
                      ) -> dict[str, dict[int, list[Piece]]]:
        """data.split_media: per modality of this rank, the pieces of its part, by position
        in the epoch's order (each module's items cut as ``media_split.cut`` says)."""
        config = self.source.config.modalities
        token_ids = self.source.metadata.text.modality_token_ids
        found: dict[str, dict[int, list[Piece]]] = {m: {} for m in self.role.media}
        for module in dict.fromkeys(self.role.media.values()):
            modalities = [m for m, name in self.role.media.items() if name == module]
            part = next(iter(media[m] for m in modalities))
            items: list[Item] = []
            for at in range(part.start, part.stop):
                text = texts[at]
                if not isinstance(text, TextSample):
                    continue                    # dropped: ``_sample`` says so
                counts = {m: text.token_counts.get(m, []) for m in modalities}
                metadata = {m: [item for item in text.items if item["modality"] == m]
                            for m in modalities}
                for modality, k in placeholder_order(text.ids, counts, token_ids):
                    units = MODALITIES[modality].cut_units(metadata[modality][k],
                                                           config[modality])
                    items.append(Item(at, modality, k, units, counts[modality][k]))
            parts, which = self.split[module][2:] if module in self.split else (1, 0)
            for piece in cut(items, parts)[which]:
                found[piece.modality].setdefault(piece.sample, []).append(piece)
        return found

    def _split_media(self, batch: dict[str, Any], metadata: BatchMetadata,
                     samples: dict[int, Sample], pieces: dict[str, dict[int, list[Piece]]]
                     ) -> None:
        """data.split_media: this rank's part of its samples' media as its encoder inputs;
        ``input_ids`` one row of the part's placeholders, in order (what an encoder rank reads
        of them: which modality each row is, whether there are any), checked as a batch."""
        config = self.source.config.modalities
        token_ids = self.source.metadata.text.modality_token_ids
        inputs: dict[str, dict[str, dict[str, Any]]] = {}
        order = sorted((piece for part in pieces.values() for at in part for piece in part[at]),
                       key=lambda piece: (piece.sample, _first_token(samples[piece.sample],
                                                                     piece, token_ids)))
        counts: dict[str, list[list[int]]] = {m: [[]] for m in config}
        for modality, part in pieces.items():
            taken = [(at, piece) for at in sorted(part) for piece in part[at]]
            counts[modality] = [[piece.tokens for _, piece in taken]]
            if not taken or self.full is None:
                continue
            before, items = 0, {}
            for at in sorted(part):                         # the part's samples' items, in order
                items[at] = before
                before += len(samples[at].token_counts[modality])
            collated, _ = self.collate([samples[at] for at in sorted(part)])
            inputs[modality] = {modality: MODALITIES[modality].take(
                collated["modality_inputs"][modality][modality], config[modality],
                [(items[at] + piece.item, piece.first, piece.stop) for at, piece in taken])}
        row = torch.tensor([token_ids[piece.modality] for piece in order
                            for _ in range(piece.tokens)], dtype=torch.int64)[None]
        self.collate.check(cast(Batch, {"input_ids": row, "packing_kwargs": None,
                                        "modality_inputs": inputs}),
                           BatchMetadata(keys=["part"], token_counts=counts, removed_turns=[0]))
        if "input_ids" in batch:
            batch["input_ids"] = row
        batch["modality_inputs"] = inputs
        metadata["encoder_keys"] = {m: [samples[at].key for at in sorted(part)]
                                    for m, part in pieces.items()}
        metadata["media_parts"] = {m: [[samples[p.sample].key, p.item, p.first, p.stop]
                                       for p in order if p.modality == m] for m in pieces}

    def micro_batch(self, epoch: int, index: int) -> tuple[dict[str, Any], BatchMetadata]:
        """This rank's part of global micro-batch ``index`` (counted over the epoch)."""
        step, micro = divmod(index, self.per_step)
        datasets, positions = self.order.epoch(epoch)
        text, media = self._parts(index)
        needed = self._needed(index)
        if any((epoch, at) not in self._ahead for at in needed):
            self._text_ahead(epoch, index)
        records, texts = {}, []
        for at in needed:
            records[at], text_sample = self._ahead.pop((epoch, at))
            texts.append(text_sample)
        pieces = self._media_pieces(dict(zip(records, texts)), media) if self.split else None
        full_at = set() if not self.full else \
            {at for part in pieces.values() for at in part} if pieces is not None else \
            {at for part in media.values() for at in range(part.start, part.stop)}
        samples = {at: self._sample(datasets, positions, at, record, text_sample,
                                    at in full_at)
                   for (at, record), text_sample in zip(records.items(), texts)}
        text_samples = [samples[at] for at in range(text.start, text.stop)]
        if pieces is not None:              # the text of samples only some of whose media
            text_samples = [dataclasses.replace(sample, encoder_inputs={})  # this rank takes
                            for sample in text_samples]
        collated, metadata = self.collate_text(text_samples)
        batch: dict[str, Any] = {key: value for key, value in collated.items()
                                 if key in self.role.text_keys}
        metadata["epoch"], metadata["step"], metadata["micro_batch"] = epoch, step, micro
        metadata["tokens"] = [len(sample.input_ids) for sample in text_samples]
        metadata["trained_tokens"] = [int(np.count_nonzero(sample.loss_mask.numpy()))
                                      for sample in text_samples]
        by_at = dict(zip(records, texts))
        metadata["token_grids"] = self._token_grids(
            [by_at[at] for at in range(text.start, text.stop)])
        if self.packing is not None:
            metadata["sequences"] = next_fit(metadata["tokens"], self.packing.capacity)
        if self.role.media and pieces is not None:
            self._split_media(batch, metadata, samples, pieces)
        elif self.role.media:
            batch["modality_inputs"] = {}
            encoder_keys: dict[str, list[str]] = {}
            metadata["encoder_keys"] = encoder_keys
            for modality, part in media.items():
                if part != text:
                    part_batch, part_metadata = self.collate(
                        [samples[at] for at in range(part.start, part.stop)])
                else:
                    part_batch, part_metadata = collated, metadata
                if modality in part_batch["modality_inputs"]:
                    batch["modality_inputs"][modality] = part_batch["modality_inputs"][modality]
                encoder_keys[modality] = list(part_metadata["keys"])
        return batch, metadata


def _ignore(signals: tuple[int, ...], worker_id: int) -> None:
    """A worker's start: ``signals`` ignored. They are the rank's to handle (a run's exit
    signals, which stop it after a step); torchrun and Slurm send them to every process of the
    rank, and a worker they killed would fail the rank's step. The rank stops its workers
    itself (``RankLoader.close``), and they end with it (torch's watchdog) when it dies."""
    for number in signals:
        signal.signal(number, signal.SIG_IGN)


def _first_token(sample: Sample, piece: Piece, token_ids: dict[str, int]) -> int:
    """Where ``piece``'s item's placeholders start in its sample (its order among the
    sample's items of other modalities)."""
    at = np.flatnonzero(sample.input_ids.numpy() == token_ids[piece.modality])
    return int(at[sum(sample.token_counts[piece.modality][:piece.item])])


class RankLoader:
    """One rank's micro-batches: iterate for the rest of the current epoch; resumable.

    Each item is ``(batch, metadata)``. ``batch`` holds the role's keys of collate.Collator's
    batch (``role.text_keys``; ``modality_inputs`` with only this rank's modalities on encoder
    ranks). ``metadata``: ``epoch``, ``step``, ``micro_batch`` (global micro-batch index in the
    step); for the samples of the text tensors, ``keys`` (sample ids ``"D/KEY"``: D the
    dataset's index in the datasets list), ``token_counts``, ``removed_turns``, ``tokens`` and
    ``trained_tokens``; on encoder ranks ``encoder_keys`` ``{modality: ids}`` of the samples
    whose encoder inputs the batch holds (the text samples unless a colocated encoder's DP
    slice differs from the language model's); with packing, on language ranks, ``sequences``
    (samples per packed sequence). With ``split_media``, on the encoder ranks it cuts, the text
    metadata is the language rank's samples', ``input_ids`` one row of the rank's part's
    placeholders in order, and ``media_parts`` ``{modality: [[key, item, first, stop], ...]}``
    the part's pieces (temporal patches ``first..stop - 1`` of the sample's item). TP/CP ranks
    of one DP rank get the same data.
    """

    def __init__(self, source: DataSource, layout: Layout, role: RankRole, order: SampleOrder,
                 micro_batch_size: int, decode_media: bool = True, num_workers: int = 0,
                 prefetch_factor: int | None = 2, pin_memory: bool = False,
                 multiprocessing_context=None, split_media: bool = False,
                 parent_signals: tuple[int, ...] = ()):
        self.source = source
        self.layout = layout
        self.role = role
        self.order = order
        self.micro_batch_size = micro_batch_size
        self.global_micro_batch_size = layout.global_micro_batch_size(micro_batch_size)
        self.micro_batches_per_step = order.global_batch_size // self.global_micro_batch_size
        self.decode_media = decode_media
        if not (decode_media and role.media):
            num_workers = 0         # in-process: see the module docstring, "Workers"
        self._loader_options = {"num_workers": num_workers, "pin_memory": pin_memory,
                                "multiprocessing_context": multiprocessing_context if
                                num_workers else None,
                                "prefetch_factor": prefetch_factor if num_workers else None,
                                "worker_init_fn": functools.partial(_ignore, parent_signals)
                                if num_workers and parent_signals else None}
        self.epoch, self.index = 0, 0
        self._stream: Iterator[Any] | None = None
        self._workers: set[multiprocessing.process.BaseProcess] = set()
        # data.split_media (``media_split``): each fanning-in encoder module of this rank ->
        # (language dp, the language DP rank it feeds, its ranks per language rank, which)
        self.split: dict[str, tuple[int, int, int, int]] = {}
        language = layout.language
        for part in role.modules if split_media else ():
            if part.name != LANGUAGE and layout.fans_in(part.module):
                share = part.dp_size // language.dp
                self.split[part.name] = (language.dp, part.dp_rank // share, share,
                                         part.dp_rank % share)

    # ------------------------------------------------------------------------- positions

    @property
    def steps_per_epoch(self) -> int:
        return self.order.steps_per_epoch

    @property
    def micro_batches_per_epoch(self) -> int:
        return self.steps_per_epoch * self.micro_batches_per_step

    @property
    def step(self) -> int:
        """Steps of the current epoch fully consumed by this rank."""
        return self.index // self.micro_batches_per_step

    def __len__(self) -> int:
        return self.micro_batches_per_epoch

    def _next(self) -> tuple[dict, dict]:
        if self._stream is None:
            if self._loader_options["num_workers"]:
                # the epoch's order made here, once: forked workers inherit it (its pages
                # shared) instead of each making its own (12 bytes a sample, seconds at 10M)
                self.order.epoch(self.epoch)
            dataset = _RankStream(self.source, self.order, self.role,
                                  self.global_micro_batch_size, self.decode_media,
                                  (self.epoch, self.index), self.split)
            before = set(multiprocessing.active_children())
            # a generator of its own: torch draws the workers' base seed from it each time an
            # iterator starts (a resume, every evaluation), which from the global generator
            # would move the training's random stream (dropout) by one draw each time
            self._stream = iter(torch.utils.data.DataLoader(
                dataset, batch_size=None, collate_fn=_as_is,
                generator=torch.Generator().manual_seed(self.order.seed),
                **self._loader_options))
            if self._loader_options["num_workers"]:
                self.order.release()        # the workers hold it now
            # the iterator's workers, started with it (``close`` ends any still alive)
            self._workers = set(multiprocessing.active_children()) - before
        batch, metadata = next(self._stream)
        if isinstance(batch, tuple):                         # packed by a worker
            batch = unpack(*batch)
        step, micro = divmod(self.index, self.micro_batches_per_step)
        if (metadata["epoch"], metadata["step"], metadata["micro_batch"]) != \
                (self.epoch, step, micro):
            raise LoaderError(f"rank {self.role.rank}: expected epoch {self.epoch} step {step} "
                              f"micro-batch {micro}, got {metadata['epoch']}/{metadata['step']}"
                              f"/{metadata['micro_batch']}; this is a bug in mimo, report it")
        self.index += 1
        if self.index == self.micro_batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return batch, metadata

    def __iter__(self):
        """``(batch, metadata)`` micro-batches until the end of the current epoch."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self._next()

    def close(self) -> None:
        """Stop the workers; the next iteration starts them again where this one stopped. A
        worker still alive after torch's shutdown (stuck in a read) is killed: it ignores the
        SIGTERM torch's shutdown ends with (``_ignore``), and the interpreter's exit would
        wait for it."""
        self._stream = None                 # torch's shutdown, as the iterator goes
        for worker in self._workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
        self._workers = set()

    # ----------------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """Where this rank stands: restoring it continues after the last consumed micro-batch."""
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "seed": self.order.seed,
                "epoch": self.epoch, "sample_offset": self.index * self.global_micro_batch_size,
                "step": self.step, "micro_batch": self.index % self.micro_batches_per_step,
                "global_batch_size": self.order.global_batch_size,
                "fingerprint": self.source.fingerprint, "data": self.source.fingerprinted,
                "quotas": self.order.quotas,
                "arrangement": self._arrangement,
                "step_order": self._step_order(self.epoch, self.index *
                                               self.global_micro_batch_size)}

    def _step_order(self, epoch: int, offset: int) -> str | None:
        """A digest of the samples a step's part before ``offset`` (samples into ``epoch``)
        holds, as a set; None at a step boundary. A mid-step state resumes exactly only where
        that part holds the same samples, so that the rest of the step holds the others: a
        balanced step's places follow the samples' token counts, which other preprocessing
        (media budgets, a template) changes while keeping the same samples (the same
        fingerprint). A set: packing's order within a micro-batch is the layout's own."""
        batch = self.order.global_batch_size
        if not offset % batch:
            return None
        datasets, positions = self.order.epoch(epoch)
        start = offset - offset % batch
        pairs = np.sort(datasets[start:offset].astype(np.int64) << 40 |
                        positions[start:offset].astype(np.int64))
        return hashlib.sha256(pairs.tobytes()).hexdigest()[:16]

    @property
    def _arrangement(self) -> str:
        return "none" if self.order.arrangement is None else str(self.order.arrangement)

    def load_state_dict(self, state: dict, allow_fingerprint_mismatch: bool = False) -> None:
        """Continue after ``state``'s last consumed micro-batch; LoaderError when ``state``
        belongs to other data (unless allowed), another seed or another global batch size."""
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise LoaderError(f"not a {STATE_FORMAT} version {STATE_VERSION} state: "
                              f"{state.get('format')!r} version {state.get('version')!r}")
        if state["fingerprint"] != self.source.fingerprint and not allow_fingerprint_mismatch \
                and not _same_blend(self.source, state):
            changed = data_changes(state["data"], self.source.fingerprinted) \
                if "data" in state else ""
            raise LoaderError(
                f"the loader state was saved for other data (fingerprint "
                f"{state['fingerprint'][:12]}..., these datasets give "
                f"{self.source.fingerprint[:12]}...: "
                + (changed or "different shards, blend weights or preprocessing drops, which a "
                   "mimo version that keeps other samples under the same config changes too")
                + "), so the order would not continue where it stopped. "
                "Use the same datasets and config; to train the checkpoint's weights on other "
                "data, start a new run from them (model.init_from=CHECKPOINT, another "
                "checkpoint.dir: a new optimizer and sample stream); mimo-train has no key "
                "that resumes the old position in another order")
        quotas = state.get("quotas")                 # (none in states before 2026-12-08)
        if quotas is not None and quotas != self.order.quotas and \
                not allow_fingerprint_mismatch:
            raise LoaderError(
                f"the loader state's blend gave its datasets {listed(map(str, quotas))} "
                f"samples an epoch, these weights give {listed(map(str, self.order.quotas))} "
                "(weights written otherwise, the same shares but for their last bits, can "
                "round a dataset's share the other way), so the order would not continue "
                "where it stopped: give data.weights as the run gave them")
        if state["global_batch_size"] != self.order.global_batch_size:
            raise LoaderError(f"the loader state has global batch {state['global_batch_size']}, "
                              f"this run {self.order.global_batch_size}: resuming exactly "
                              f"needs train.global_batch_size={state['global_batch_size']}")
        if state["seed"] != self.order.seed:
            raise LoaderError(f"the loader state has seed {state['seed']}, this run "
                              f"{self.order.seed}: set train.seed={state['seed']} (the "
                              "loader's seed) to continue the same order")
        offset, epoch = state["sample_offset"], state["epoch"]
        if not all(isinstance(value, int) and not isinstance(value, bool) and value >= 0
                   for value in (offset, epoch)):
            raise LoaderError(f"the loader state's epoch {epoch!r} and sample_offset {offset!r} "
                              "must be whole numbers >= 0: not a state this loader saved")
        if offset % self.global_micro_batch_size or offset >= self.order.samples_per_epoch:
            raise LoaderError(
                f"the loader state stopped {offset} samples into epoch {state['epoch']}, which "
                f"is not a whole number of global micro-batches of "
                f"{self.global_micro_batch_size} within this epoch's "
                f"{self.order.samples_per_epoch} samples; resume from a state saved at a step "
                "boundary (always possible for any layout with the same global batch size)")
        if state.get("arrangement", "none") != self._arrangement and \
                offset % self.order.global_batch_size:
            raise LoaderError(
                f"the loader state stopped inside a step arranged as "
                f"{state.get('arrangement', 'none')!r}; this loader arranges steps as "
                f"{self._arrangement!r} (balance, layout or micro batch changed), so the rest of "
                "that step would not hold exactly its remaining samples. Resume from a state "
                "saved at a step boundary (every checkpoint is), or keep the arrangement")
        if state.get("step_order") is not None and not allow_fingerprint_mismatch and \
                state["step_order"] != self._step_order(epoch, offset):
            raise LoaderError(
                f"the loader state stopped inside step {offset // self.order.global_batch_size} "
                f"of epoch {epoch}, which this loader orders otherwise (with data.balance the "
                "places follow the samples' token counts: other media budgets, seq_length or "
                "template give others, with the same samples kept), so the rest of that step "
                "would not hold exactly its remaining samples. Resume from a state saved at a "
                "step boundary (every checkpoint is), or with the preprocessing it was saved with")
        self.epoch = epoch
        self.index = offset // self.global_micro_batch_size
        self.close()

    def report(self) -> dict:
        """Drops by reason, epoch length, steps and the remainder dropped or padded."""
        return {"samples": self.source.tally.to_dict(),
                "epoch_samples": self.order.epoch_length,
                "steps_per_epoch": self.steps_per_epoch,
                "remainder": self.order.remainder,
                "remainder_samples": self.order.remainder_samples}

    def summary(self) -> str:
        """``report`` in a line: samples kept and dropped by reason, the records the builds
        skipped, what an epoch draws from each of several datasets (their blend), steps an
        epoch, the remainder's samples (dropped, or repeated to fill the last step) and
        whether steps are token-balanced and packed."""
        order = self.order
        remainder = order.remainder_samples
        left = (f"; {remainder} sample(s) an epoch "
                f"{'left out' if order.remainder == 'drop' else 'repeated'} by the "
                f"remainder ({order.remainder})" if remainder else "")
        kept = [d.kept_count for d in order.datasets]
        blend = (f"; an epoch draws {' + '.join(map(str, order.quotas))} samples of the "
                 f"{len(kept)} datasets (kept {' + '.join(map(str, kept))})"
                 if len(kept) > 1 else "")
        # records the builds skipped (an Energon split.yaml's exclusions are the data's own)
        reports = [reader.index.get("report") or {} for reader in self.source.readers]
        skipped = sum(report.get("records_skipped", 0) - report.get("records_excluded", 0)
                      for report in reports)
        built = (f" (the build{'s' if len(reports) > 1 else ''} skipped {skipped} record(s): "
                 "mimo-inspect report names them)" if skipped else "")
        return (f"{self.source.tally.summary()}{built}{blend}; {self.steps_per_epoch} step(s) "
                f"an epoch{left}{'; token-balanced' if order.arrangement is not None else ''}"
                f"{'; packed' if order.packing is not None else ''}")


def _same_blend(source: DataSource, state: dict) -> bool:
    """Whether ``state``'s data differs from ``source``'s only in its blend weights' shares'
    last bits (weights written [1, 2, 3] then, [0.1, 0.2, 0.3] now), and the state holds the
    samples an epoch its blend gave each dataset (its quotas, which such weights can round the
    other way: ``load_state_dict`` checks them); a state saved without them never does."""
    then = (state.get("data") or {}).get("weights")
    if then is None or not same_shares(then, source.fingerprinted["weights"]):
        return False
    return source.blended_fingerprint(then) == state["fingerprint"] and "quotas" in state


def same_shares(then: list | None, now: list[float] | None) -> bool:
    """Whether two blends' shares (a state's, these datasets') are one but for their last
    bits (weights written [1, 2] then, [0.3, 0.6] now)."""
    if then is None or now is None:
        return then is now
    return len(then) == len(now) and all(
        isinstance(a, float) and math.isclose(a, b, rel_tol=1e-9) for a, b in zip(then, now))


def data_changes(then: dict, now: dict) -> str:
    """What differs between two ``DataSource.fingerprinted``: datasets added or gone, a
    dataset's index (rebuilt, other shards), the samples preprocessing keeps of it, the blend
    weights; "" where none of these."""
    changes = []
    before, after = then["datasets"], now["datasets"]
    if len(before) != len(after):
        changes.append(f"{len(before)} dataset(s) then ({listed(d['directory'] for d in before)}"
                       f"), {len(after)} now ({listed(d['directory'] for d in after)})")
    elif [d["index"] for d in before] != [d["index"] for d in after] and \
            sorted(d["index"] for d in before) == sorted(d["index"] for d in after):
        order = [listed(d["directory"] for d in datasets) for datasets in (before, after)]
        changes.append(f"the same datasets in another order ({order[0]} then, {order[1]} now)")
    else:
        for old, new in zip(before, after):
            if old["index"] != new["index"]:
                changes.append(f"{new['directory']}: another index than {old['directory']}'s "
                               "then (rebuilt, or other shards)")
            elif old["kept_digest"] != new["kept_digest"]:
                changes.append(f"{new['directory']}: preprocessing keeps {new['kept']} of its "
                               f"samples now, {old['kept']} then" if new["kept"] != old["kept"]
                               else f"{new['directory']}: preprocessing keeps other samples "
                               "than then")
    if not same_shares(then["weights"], now["weights"]):
        def said(weights: list[float] | None) -> str:
            return "none (each dataset by its size)" if weights is None else \
                listed(f"{w:.3g}" for w in weights)
        changes.append(f"blend weights {said(then['weights'])} then, {said(now['weights'])} "
                       "now (as shares)")
    return "; ".join(changes)


def build_loader(datasets, preprocess_config, layout, rank: int, world_size: int,
                 global_batch_size: int, micro_batch_size: int, seed: int,
                 num_workers: int = 0, remainder: str = "drop", state: dict | None = None, *,
                 weights=None, decode_media: bool = True, allow_fingerprint_mismatch=False,
                 prefetch_factor: int | None = 2, pin_memory: bool = False,
                 multiprocessing_context=None, block_size: int = 64, window_blocks: int = 4,
                 progress: bool = False, balance: str = "none",
                 packing: bool = False, split_media: bool = False,
                 parent_signals: tuple[int, ...] = ()) -> RankLoader | None:
    """The loader of ``rank``, or None when its role needs no data (nothing is opened then).

    ``datasets``: dataset directories (or a ``DataSource`` already opened in this process, e.g.
    to build several ranks' loaders); ``weights``: blend weights (None: every kept sample once
    per epoch); ``decode_media=False`` gives encoder ranks token counts without encoder inputs
    (dry runs); ``balance="tokens"`` arranges each global batch so that every module's DP ranks
    get near-equal tokens (``balance.py``); ``packing=True`` packs each language DP rank's
    micro-batch into sequences of ``seq_length`` (``packing.py``); ``split_media=True`` cuts
    each language rank's media over the encoder ranks fanning in to it, a clip between its
    temporal patches (``media_split.py``); ``parent_signals``: signals the rank handles, which
    its workers ignore. The layout is validated against the world and batch sizes first.
    """
    if balance not in BALANCE:
        raise ValueError(f"balance is {balance!r}: use one of {', '.join(BALANCE)}")
    layout = Layout.parse(layout)
    if isinstance(datasets, DataSource):
        source = datasets
        config = source.config if preprocess_config is None else (
            preprocess_config if isinstance(preprocess_config, PreprocessConfig)
            else PreprocessConfig.from_yaml(str(preprocess_config)))
        if config != source.config or (weights is not None and
                                       [float(w) for w in weights] != source.weights):
            raise ValueError("the DataSource was opened with another preprocessing config or "
                             "other weights than this loader asks for")
    else:
        source, config = None, (preprocess_config if isinstance(preprocess_config,
                                                                PreprocessConfig)
                                else PreprocessConfig.from_yaml(str(preprocess_config)))
    layout.validate(world_size, global_batch_size, micro_batch_size,
                    variable_token_modalities(config), modalities=list(config.modalities),
                    split_media=split_media)
    if split_media:
        check_split_media(layout, config)
    role = layout.role(rank)
    if not role.needs_data:
        return None
    if source is None:
        source = DataSource(datasets, config, weights, num_workers, progress)
    order = source.order(seed, global_batch_size, remainder, block_size, window_blocks,
                         balance_arrangement(layout, micro_batch_size, list(config.modalities),
                                             split_media) if balance == "tokens" else None,
                         Packing(micro_batch_size, config.seq_length) if packing else None)
    loader = RankLoader(source, layout, role, order, micro_batch_size, decode_media,
                        num_workers, prefetch_factor, pin_memory, multiprocessing_context,
                        split_media, parent_signals)
    if state is not None:
        loader.load_state_dict(state, allow_fingerprint_mismatch)
    return loader
