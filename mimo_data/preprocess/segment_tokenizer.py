"""Tokenizing many conversations fast, with exactly the tokens of the training tokenizer.

A fast (``tokenizers``) tokenizer first cuts the text at its added tokens (``<|im_start|>``,
``<|im_end|>``, the ``<image>``/``<audio>`` markers, ...), then normalizes, pre-tokenizes and
runs the model on each piece between them on its own. So the encoding of a rendered conversation
is the concatenation of the encodings of its pieces, and the pieces repeat a lot across a
dataset: the template's system prompt, ``user\\n``, ``assistant\\n``, fixed instructions such as
``\\nDescribe the image.``. ``SegmentCachedTokenizer`` encodes each distinct piece once and
concatenates cached ids and offsets. ``TextEncoder`` tokenizes through it (training and
mimo-inspect alike) unless told not to.

The decomposition holds for the tokenizer families mimo supports (byte-level BPE such as
SmolLM2, Llama 3, Qwen2; sentencepiece-style with ``prepend_scheme: always``). It does not hold
when an added token strips its neighbours' whitespace (``lstrip``/``rstrip``/``single_word``),
when added tokens are matched after normalization, when BPE dropout is on, or for a Metaspace
pre-tokenizer that prepends only to the first piece; ``unsupported_reason`` detects those and
the caller then uses the tokenizer as is. Besides, the first ``verify_first`` encodings and one
in ``verify_every`` afterwards are checked against the plain tokenizer: a difference raises
``SegmentCacheError`` instead of producing different tokens than training would.

New pieces are encoded in one batch call. For byte-level BPE tokenizers (``byte_level_lengths``)
an ASCII piece's character offsets are the running sum of its tokens' lengths, so those pieces
go through the tokenizer's ``encode_batch_fast``, which computes no offsets, and the offsets
are summed here: building the offsets as Python tuples costs about as much as a third of the
tokenizer's own work, and the tokenizer has no array output. Every such batch is checked to sum
to its pieces' lengths, the tokenizer is probed at construction, and the sampled verification
above compares offsets too.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np
from tokenizers import Tokenizer, models


# warm() batches for cache locality, not for threads: preprocessing runs one core per
# DataLoader worker, and a tokenizers thread pool started before a DataLoader forks its workers
# leaves threads behind the fork (Python warns of deadlocks). An explicit setting is kept.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class SegmentCacheError(RuntimeError):
    """The cached encoding of a text differs from the tokenizer's own (a bug to report);
    ``index``: which of the texts encoded together."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index

    def __reduce__(self):
        # both arguments (RuntimeError's pickling passes the message alone): raised in a
        # report's worker process, it reaches the command as itself
        return type(self), (self.index, str(self))


@dataclass
class TokenBatch:
    """The tokens of several texts, concatenated: text ``i`` has tokens ``bounds[i]:bounds[i +
    1]``; ``offsets`` are character offsets into the concatenation of the texts."""
    ids: np.ndarray        # [N] int64
    offsets: np.ndarray    # [N, 2] int64
    bounds: np.ndarray     # [texts + 1] int64

    def text(self, i: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Ids and offsets of text ``i`` (which starts at character ``start``)."""
        a, b = self.bounds[i], self.bounds[i + 1]
        return self.ids[a:b], self.offsets[a:b] - start


def encode_texts(backend, texts: list[str]) -> TokenBatch:
    """``texts`` tokenized by ``backend`` (a ``SegmentCachedTokenizer`` or a ``tokenizers``
    Tokenizer that does not pad), without special tokens, as one TokenBatch."""
    if isinstance(backend, SegmentCachedTokenizer):
        return backend.encode_texts(texts)
    if backend.padding is not None:     # a batch would be padded to its longest text
        raise ValueError("cannot tokenize texts in a batch with a tokenizer that pads")
    rows, counts = _tokenizer_rows(backend, texts)
    return _token_batch(rows, counts, texts, [1] * len(texts))


def _tokenizer_rows(backend: Tokenizer, texts: list[str]) -> tuple[np.ndarray, list[int]]:
    """[tokens, 3] rows (id, start, end) of ``texts`` as the tokenizer encodes them (offsets
    relative to each text), and each text's token count."""
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    ids = [encoding.ids for encoding in encodings]
    rows = _rows(ids)
    # Read through a generator: each text's offset tuples are freed once read (a list of them
    # all keeps tens of thousands of tuples alive for the garbage collector to walk).
    offsets = (encoding.offsets for encoding in encodings)
    rows[:, 1:] = np.fromiter(chain.from_iterable(chain.from_iterable(offsets)), np.int64,
                              count=2 * len(rows)).reshape(-1, 2)
    return rows, list(map(len, ids))


def _char_starts(strings: list[str]) -> np.ndarray:
    """Where each string starts in their concatenation, and the total length at the end."""
    return np.fromiter(accumulate(map(len, strings), initial=0), np.int64,
                       count=len(strings) + 1)


def _token_batch(rows: np.ndarray, counts: list[int], pieces: list[str],
                 per_text: list[int]) -> TokenBatch:
    """The TokenBatch of consecutive pieces' rows (``counts`` tokens each, offsets relative to
    the piece), texts made of ``per_text`` pieces each."""
    offsets = rows[:, 1:] + np.repeat(_char_starts(pieces)[:-1], counts)[:, None]
    ends = np.fromiter(accumulate(counts, initial=0), np.int64, count=len(counts) + 1)
    bounds = ends[np.fromiter(accumulate(per_text, initial=0), np.int64,
                              count=len(per_text) + 1)]
    return TokenBatch(np.ascontiguousarray(rows[:, 0]), offsets, bounds)


def _rows(ids: list[list[int]]) -> np.ndarray:
    """[tokens, 3] rows (id, start, end) of several pieces' ids, offsets left to fill."""
    rows = np.empty((sum(map(len, ids)), 3), dtype=np.int64)
    rows[:, 0] = np.fromiter(chain.from_iterable(ids), np.int64, count=len(rows))
    return rows


def _entries(pieces: list[str], counts: list[int], rows: np.ndarray) -> dict[str, np.ndarray]:
    """Each piece's rows (``counts`` each), by piece."""
    return dict(zip(pieces, np.split(rows, np.cumsum(counts[:-1]))))


def _walk(node):
    """Every dict inside a tokenizer.json component (Sequence members included)."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _part(backend: Tokenizer, name: str) -> dict | None:
    """One component of the tokenizer (``normalizer``, ``pre_tokenizer``, ``post_processor``)
    as tokenizer.json spells it, serialized alone: ``to_str`` writes the whole vocabulary too
    (~0.3 s to write and parse for a 150k-token tokenizer, at every rank's start-up)."""
    part = getattr(backend, name)
    return None if part is None else json.loads(part.__getstate__())


def unsupported_reason(backend: Tokenizer) -> str | None:
    """Why piece-by-piece encoding could differ from ``backend.encode`` (None: it cannot)."""
    # A tokenizer.json saved with padding or truncation on keeps it (transformers too): a batch
    # of pieces would be padded to its longest, and each piece cut instead of the whole text.
    if backend.padding is not None:
        return "the tokenizer pads its encodings"
    if backend.truncation is not None:
        return "the tokenizer truncates its encodings"
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word:
            return f"added token {token.content!r} strips or requires whitespace around it"
        if token.normalized and backend.normalizer is not None:
            return f"added token {token.content!r} is matched after normalization"
    if getattr(backend.model, "dropout", None):
        return "the model uses BPE dropout"
    for node in _walk(_part(backend, "pre_tokenizer")):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            return "the Metaspace pre-tokenizer prepends only to the first piece"
    return None


# Pre-tokenizers that cut a piece into words without dropping or changing characters.
_CUTTING = {"ByteLevel", "Digits", "Split", "Sequence"}
_ASCII_PROBE = "Hello, world!  It's 2024:\n\n\tx = [1, 22, 333]  # done...   \n"


class TokenLengths:
    """Characters per token id (``lengths[ids]``), each id's read from the tokenizer when first
    met: a table of the whole vocabulary costs ~0.2-0.4 s at every rank's start-up for a
    150-250k-token tokenizer, of which a run meets a small share."""

    def __init__(self, backend: Tokenizer):
        self._backend = backend
        self._lengths = np.full(backend.get_vocab_size(with_added_tokens=True), -1,
                                dtype=np.int64)

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        lengths = self._lengths[ids]
        unknown = lengths < 0
        if unknown.any():
            for token_id in np.unique(ids[unknown]).tolist():
                token = self._backend.id_to_token(token_id)
                self._lengths[token_id] = 0 if token is None else len(token)
            lengths = self._lengths[ids]
        return lengths


def byte_level_lengths(backend: Tokenizer) -> TokenLengths | None:
    """Characters per token id when ``backend`` is byte-level BPE whose ASCII offsets are the
    running sum of its tokens' lengths (no normalizer that could change ASCII, no offset
    trimming, no subword prefixes); None otherwise, or if a probe text says otherwise."""
    model = backend.model
    normalizers = [node.get("type") for node in _walk(_part(backend, "normalizer"))]
    pre_tokenizers = list(_walk(_part(backend, "pre_tokenizer")))
    if (not isinstance(model, models.BPE) or model.byte_fallback or
            model.continuing_subword_prefix or model.end_of_word_suffix or
            not set(normalizers) <= {"NFC", "NFD", "NFKC", "NFKD", "Sequence"} or
            "ByteLevel" not in [node.get("type") for node in pre_tokenizers] or
            any(node.get("type") not in _CUTTING or node.get("behavior") == "Removed"
                for node in pre_tokenizers if "type" in node) or
            any(node.get("trim_offsets") for node in _walk(_part(backend, "post_processor")))):
        return None
    lengths = TokenLengths(backend)
    probe = backend.encode(_ASCII_PROBE, add_special_tokens=False)
    probe_lengths = lengths[np.array(probe.ids, dtype=np.int64)]
    ends = np.cumsum(probe_lengths)
    if [tuple(o) for o in probe.offsets] != list(zip((ends - probe_lengths).tolist(),
                                                     ends.tolist())):
        return None
    return lengths


def _added_token_split(tokens):
    """``split(text)`` → [piece, added token, piece, ...] as the added vocabulary cuts a text:
    leftmost match, longest first at a position, of the tokens matched before normalization,
    then of the normalized ones in the pieces between those (unsupported_reason: there is no
    normalizer then, so both passes see the raw text)."""
    def splitter(contents):
        contents = sorted(contents, key=len, reverse=True)
        return (re.compile("(" + "|".join(map(re.escape, contents)) + ")").split
                if contents else None)

    tokens = list(tokens)
    first = {token.content for token in tokens if not token.normalized}
    first_split = splitter(first)
    then_split = splitter({token.content for token in tokens if token.normalized} - first)
    if then_split is None:
        return first_split or (lambda text: [text])
    if first_split is None:
        return then_split
    # The second pass cuts only the pieces between the first pass's tokens (even positions).
    return lambda text: [part for k, piece in enumerate(first_split(text))
                         for part in (then_split(piece) if k % 2 == 0 else (piece,))]


class SegmentCachedTokenizer:
    """``encode_texts(texts)`` equal to ``backend.encode(text, add_special_tokens=False)`` for
    each text, from cached encodings of the pieces between added tokens."""

    # A piece that never repeats (an answer) costs a few kB here until the cache is full and
    # starts over: 4096 entries keep a DataLoader worker's share to about 10 MB.
    def __init__(self, backend: Tokenizer, *, max_entries: int = 1 << 12,
                 verify_first: int = 64, verify_every: int = 256):
        reason = unsupported_reason(backend)
        if reason is not None:
            raise ValueError(f"piece-by-piece encoding would differ: {reason}")
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        self._split = _added_token_split(added.values())
        # A piece's entry: [tokens, 3] rows (id, start, end), offsets relative to the piece.
        # Added tokens are pieces too, never evicted: a text piece never equals one (the split
        # would have cut it out), so one lookup serves both.
        self._added = {token.content: np.array([[token_id, 0, len(token.content)]],
                                               dtype=np.int64)
                       for token_id, token in added.items()}
        self._cache: dict[str, np.ndarray] = dict(self._added)
        self._token_lengths = byte_level_lengths(backend)
        self.max_entries = max_entries
        self.verify_first = verify_first
        self.verify_every = verify_every
        self.calls = 0
        self.pieces = 0
        self.misses = 0

    @property
    def hits(self) -> int:
        """Pieces served from the cache (added tokens included)."""
        return self.pieces - self.misses

    def __getattr__(self, name):          # token_to_id, decode, ...: the tokenizer's own
        if name == "backend":             # not set yet: an instance being copied or unpickled
            raise AttributeError(name)
        return getattr(self.backend, name)

    def _encode_new(self, pieces: list[str]) -> dict[str, np.ndarray]:
        """Entries of pieces missing from the cache, in batch calls (a batch runs the tokenizer
        with its tables in the CPU caches: about half the time per piece of single calls amid
        other work, measured with SmolLM2); cached while there is room."""
        self.misses += len(pieces)
        summed = ([piece for piece in pieces if piece.isascii()]
                  if self._token_lengths is not None else [])
        new = self._encode_summing_offsets(summed) if summed else {}
        if len(new) < len(pieces):
            new.update(self._encode_with_offsets([p for p in pieces if p not in new]))
        if len(self._cache) + len(new) > self.max_entries + len(self._added):
            self._cache = dict(self._added)
        for piece in pieces[:self.max_entries]:
            self._cache[piece] = new[piece]
        return new

    def _encode_with_offsets(self, pieces: list[str]) -> dict[str, np.ndarray]:
        rows, counts = _tokenizer_rows(self.backend, pieces)
        return _entries(pieces, counts, rows)

    def _encode_summing_offsets(self, pieces: list[str]) -> dict[str, np.ndarray]:
        """ASCII pieces of a byte-level tokenizer: ids from ``encode_batch_fast``, offsets
        summed from the tokens' lengths (see the module docstring)."""
        ids = [encoding.ids for encoding in
               self.backend.encode_batch_fast(pieces, add_special_tokens=False)]
        rows = _rows(ids)
        assert self._token_lengths is not None        # only called for byte-level tokenizers
        lengths = self._token_lengths[rows[:, 0]]
        ends = np.cumsum(lengths)
        piece_starts = _char_starts(pieces)
        counts = list(map(len, ids))
        tokens = np.array(counts, dtype=np.int64)
        last = np.cumsum(tokens)[tokens > 0] - 1         # each piece's last token
        if not np.array_equal(ends[last], piece_starts[1:][tokens > 0]):
            return {}       # lengths that do not add up: the tokenizer's own offsets instead
        rows[:, 2] = ends - np.repeat(piece_starts[:-1], counts)
        rows[:, 1] = rows[:, 2] - lengths
        return _entries(pieces, counts, rows)

    def encode_texts(self, texts: list[str]) -> TokenBatch:
        """The tokens of ``texts`` as one TokenBatch, each text's equal to the tokenizer's."""
        # split() with a capturing group: [piece, added token, piece, ..., piece] per text.
        splits = [[part for part in self._split(text) if part] for text in texts]
        parts = [part for split in splits for part in split]
        cached = list(map(self._cache.get, parts))
        missing = [part for part, entry in zip(parts, cached) if entry is None]
        new = self._encode_new(list(dict.fromkeys(missing))) if missing else {}
        entries = [new[part] if entry is None else entry for part, entry in zip(parts, cached)]
        self.pieces += len(parts)
        rows = (np.concatenate(entries) if entries else np.zeros((0, 3), dtype=np.int64))
        # The pieces of the texts follow each other without a gap in their concatenation.
        batch = _token_batch(rows, list(map(len, entries)), parts, list(map(len, splits)))
        text_start = 0
        for i, text in enumerate(texts):
            self.calls += 1
            if self.calls <= self.verify_first or self.calls % self.verify_every == 0:
                self._verify(i, text, *batch.text(i, text_start))
            text_start += len(text)
        return batch

    def _verify(self, i: int, text: str, ids: np.ndarray, offsets: np.ndarray) -> None:
        reference = self.backend.encode(text, add_special_tokens=False)
        if (reference.ids != ids.tolist() or
                [tuple(o) for o in reference.offsets] != [tuple(o) for o in offsets.tolist()]):
            raise SegmentCacheError(
                i, f"cached tokenization differs from the tokenizer's own for the text "
                f"{text[:80]!r}...; please report this as a mimo bug (TextEncoder(cache_tokens="
                f"False), or mimo-inspect --no-token-cache, avoids the cache meanwhile)")
