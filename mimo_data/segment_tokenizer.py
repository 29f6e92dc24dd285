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
"""

from __future__ import annotations

import json
import os
import re
from itertools import accumulate

import numpy as np
from tokenizers import Tokenizer


# warm() batches for cache locality, not for threads: preprocessing runs one core per
# DataLoader worker, and a tokenizers thread pool started before a DataLoader forks its workers
# leaves threads behind the fork (Python warns of deadlocks). An explicit setting is kept.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class SegmentCacheError(RuntimeError):
    """The cached encoding of a text differs from the tokenizer's own (a bug to report)."""


class _Encoding:
    __slots__ = ("ids", "offsets")

    def __init__(self, ids: np.ndarray, offsets: np.ndarray):
        self.ids = ids
        self.offsets = offsets


def _walk(node):
    """Every dict inside a tokenizer.json component (Sequence members included)."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def unsupported_reason(backend: Tokenizer) -> str | None:
    """Why piece-by-piece encoding could differ from ``backend.encode`` (None: it cannot)."""
    spec = json.loads(backend.to_str())
    for token in spec.get("added_tokens", []):
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return f"added token {token['content']!r} strips or requires whitespace around it"
        if token.get("normalized") and spec.get("normalizer") is not None:
            return f"added token {token['content']!r} is matched after normalization"
    if (spec.get("model") or {}).get("dropout"):
        return "the model uses BPE dropout"
    for node in _walk(spec.get("pre_tokenizer")):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            return "the Metaspace pre-tokenizer prepends only to the first piece"
    return None


class SegmentCachedTokenizer:
    """``encode(text)`` → ``.ids`` / ``.offsets`` (numpy) equal to ``backend.encode(text,
    add_special_tokens=False)``, from cached encodings of the pieces between added tokens."""

    # A piece that never repeats (an answer) costs a few kB here until the cache is full and
    # starts over: 4096 entries keep a DataLoader worker's share to about 10 MB.
    def __init__(self, backend: Tokenizer, *, max_entries: int = 1 << 12,
                 verify_first: int = 64, verify_every: int = 256):
        reason = unsupported_reason(backend)
        if reason is not None:
            raise ValueError(f"piece-by-piece encoding would differ: {reason}")
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        contents = sorted({token.content for token in added.values()}, key=len, reverse=True)
        # Leftmost match, longest first at a position: the added vocabulary's own rule.
        self._split = (re.compile("(" + "|".join(map(re.escape, contents)) + ")").split
                       if contents else lambda text: [text])
        # Added tokens are pieces too, never evicted: a text piece never equals one (the split
        # would have cut it out), so one lookup serves both.
        self._added = {token.content: (np.array([token_id], dtype=np.int64),
                                       np.array([[0, len(token.content)]], dtype=np.int64))
                       for token_id, token in added.items()}
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = dict(self._added)
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
        return getattr(self.backend, name)

    def _store(self, piece: str, encoding) -> tuple[np.ndarray, np.ndarray]:
        self.misses += 1
        encoded = (np.array(encoding.ids, dtype=np.int64),
                   np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2))
        self._cache[piece] = encoded
        return encoded

    def _make_room(self, entries: int) -> None:
        if len(self._cache) + entries > self.max_entries + len(self._added):
            self._cache = dict(self._added)

    def _encode_piece(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        self._make_room(1)
        return self._store(text, self.backend.encode(text, add_special_tokens=False))

    def warm(self, texts) -> None:
        """Encode the pieces of ``texts`` missing from the cache, in one batch call.

        One call for many pieces runs the tokenizer with its tables in the CPU caches: about
        half the time per piece of single calls amid other work (measured with SmolLM2). Call
        it with the texts about to be encoded (e.g. a chunk of samples)."""
        cache = self._cache
        missing = list(dict.fromkeys(piece for text in texts for piece in self._split(text)
                                     if piece and piece not in cache))
        missing = missing[:self.max_entries]
        if missing:
            self._make_room(len(missing))
            for piece, encoding in zip(missing, self.backend.encode_batch(
                    missing, add_special_tokens=False)):
                self._store(piece, encoding)

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        if add_special_tokens:
            raise ValueError("SegmentCachedTokenizer encodes with add_special_tokens=False only")
        # split() with a capturing group: [piece, added token, piece, added token, ..., piece]
        parts = [part for part in self._split(text) if part]
        cache = self._cache
        entries = [cache.get(part) or self._encode_piece(part) for part in parts]
        self.pieces += len(parts)
        if entries:
            # Each piece's offsets are relative to the piece: shift them by its start.
            starts = np.fromiter(accumulate(map(len, parts[:-1]), initial=0), np.int64,
                                 count=len(parts))
            offsets = np.concatenate([entry[1] for entry in entries])
            offsets += np.repeat(starts, [len(entry[0]) for entry in entries])[:, None]
            result = _Encoding(np.concatenate([entry[0] for entry in entries]), offsets)
        else:
            result = _Encoding(np.zeros(0, dtype=np.int64), np.zeros((0, 2), dtype=np.int64))
        self.calls += 1
        if self.calls <= self.verify_first or self.calls % self.verify_every == 0:
            self._verify(text, result)
        return result

    def _verify(self, text: str, result: _Encoding) -> None:
        reference = self.backend.encode(text, add_special_tokens=False)
        if (reference.ids != result.ids.tolist() or
                [tuple(o) for o in reference.offsets] != [tuple(o) for o in
                                                          result.offsets.tolist()]):
            raise SegmentCacheError(
                f"cached tokenization differs from the tokenizer's own for the text "
                f"{text[:80]!r}...; please report this as a mimo bug (TextEncoder(cache_tokens="
                f"False), or mimo-inspect --no-token-cache, avoids the cache meanwhile)")
