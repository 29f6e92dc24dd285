"""Media markers → their items' placeholder tokens, in the tokens of rendered conversations.

Each marker is one atomic token of the tokenizer that encodes the rendered text; it becomes its
item's run of N copies of its modality's token, between the modality's wrap tokens when it has
them, or (Qwen3-VL's video timestamps) in runs after their texts. A modality token typed
literally in the text, or markers that are not the sample's media, make a TextError naming
the sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer

from mimo_data.errors import ConfigError
from mimo_data.modalities import MARKERS
from mimo_data.preprocess.chat_render import TextError
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.segment_tokenizer import TokenBatch


class ItemTokens(NamedTuple):
    """What one media marker expands into: ``tokens`` copies of its modality's token, between
    the modality's wrap tokens; with ``texts`` (``Modality.placeholder_texts``) in
    ``len(texts)`` equal runs, each after its text and between the wrap tokens, all of them
    between the wrap tokens again."""
    modality: str
    tokens: int
    texts: tuple[str, ...] = ()


class MarkerExpander:
    """The markers and modality tokens of one config and tokenizer; ``backend``: the tokenizer
    (``tokenizers``) in which the markers are atomic added tokens."""

    def __init__(self, config: PreprocessConfig, tokenizer, backend: Tokenizer):
        self._marker_ids = {backend.token_to_id(m): modality for modality, m in MARKERS.items()}
        self.modality_token_ids = {name: tokenizer.convert_tokens_to_ids(m.token)
                                   for name, m in config.modalities.items()}
        # modality token id -> the ids of the tokens around each item's run of it
        self._wraps = {self.modality_token_ids[name]:
                       self._wrap_ids(name, m.wrap, backend, config.tokenizer)
                       for name, m in config.modalities.items() if m.wrap}
        # ``placeholder_texts`` (Qwen3-VL's timestamps) tokenized alone: in the processor's
        # text each lies between two wrap tokens, which the tokenizer splits off before its
        # pre-tokenizer (added tokens), so it tokenizes there exactly as alone; remembered
        self._run_text_ids: dict[str, list[int]] = {}
        self._plain_backend = backend
        if any(getattr(m, "timestamps", False) for m in config.modalities.values()):
            added = {t.content for t in backend.get_added_tokens_decoder().values()}
            for name, m in config.modalities.items():
                if getattr(m, "timestamps", False) and not set(m.wrap) <= added:
                    raise ConfigError(f"modalities.{name}.timestamps: the wrap tokens "
                                      f"{list(m.wrap)} are not added tokens of the tokenizer "
                                      f"{config.tokenizer!r}, so the timestamp texts between "
                                      "them would not tokenize as the processor's; use the "
                                      "model's own (e.g. <|vision_start|>, <|vision_end|>)")
        # Token id -> 1 for modality tokens (never typed in text), 2 for the atomic markers (a
        # modality token that is its own marker, as LLaVA's <image>, is a marker in text).
        size = backend.get_vocab_size(with_added_tokens=True) + 1
        self._token_kind = np.zeros(size, dtype=np.int8)
        self._token_kind[[int(i) for i in self.modality_token_ids.values()]] = 1
        self._token_kind[[int(i) for i in self._marker_ids if i is not None]] = 2
        self._modality_token = np.zeros(size, dtype=bool)
        self._modality_token[[int(i) for i in self.modality_token_ids.values()]] = True

    def is_modality_token(self, token_id: int) -> bool:
        return bool(self._modality_token[token_id])

    @staticmethod
    def _wrap_ids(modality: str, wrap: Sequence[str], backend: Tokenizer,
                  tokenizer: str) -> tuple[int, int]:
        found = {token: backend.token_to_id(token) for token in wrap}
        missing = [token for token, token_id in found.items() if token_id is None]
        if missing:
            raise ConfigError(f"modalities.{modality}.wrap names {missing}, which the tokenizer "
                              f"{tokenizer!r} does not have: is it the model's? Give the "
                              "checkpoint's own tokenizer (`mimo-train --preprocessing-for "
                              "MODEL_DIR` writes the config from the checkpoint), or wrap "
                              "tokens the tokenizer has")
        first, last = found[wrap[0]], found[wrap[1]]
        assert first is not None and last is not None
        return first, last

    def expand(self, ids: np.ndarray, trained: np.ndarray | None, marker_at: np.ndarray,
               counts: list[int], modality_tokens: list[int], texts: list[tuple[str, ...]]):
        """Each marker token → its item's run of ``count`` modality tokens, between the
        modality's wrap tokens when it has them (or, with ``texts``, ``_timed_runs``);
        ``(ids, trained, repeats)`` with the markers' runs never trained (``repeats``: tokens
        each input token became)."""
        wraps = [self._wraps.get(token) for token in modality_tokens] if self._wraps else []
        wrapped = np.array([wrap is not None for wrap in wraps], dtype=bool)
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[marker_at] = counts
        ids[marker_at] = modality_tokens
        timed = {k: self._timed_runs(modality_tokens[k], counts[k], runs)
                 for k, runs in enumerate(texts) if runs}
        if timed:
            at = list(timed)
            wrapped[at] = False
            repeats[marker_at[at]] = [len(run) for run in timed.values()]
        if wrapped.any():
            repeats[marker_at] += 2 * wrapped
        expanded = np.repeat(ids, repeats)
        if wrapped.any():
            ends = np.cumsum(repeats)[marker_at[wrapped]]
            pairs = np.array([wraps[k] for k in np.flatnonzero(wrapped)], dtype=np.int64)
            expanded[ends - repeats[marker_at[wrapped]]] = pairs[:, 0]
            expanded[ends - 1] = pairs[:, 1]
        if timed:
            starts = (np.cumsum(repeats) - repeats)[marker_at[list(timed)]].tolist()
            for start, run in zip(starts, timed.values()):
                expanded[start:start + len(run)] = run
        if trained is not None:
            trained[marker_at] = False
            trained = np.repeat(trained, repeats)
        return expanded, trained, repeats

    def span(self, item: ItemTokens) -> int:
        """How many ids ``item``'s marker becomes: its modality tokens, their wraps and, for a
        timed clip, its timestamps' texts."""
        token = self.modality_token_ids[item.modality]
        if item.texts:
            return len(self._timed_runs(token, item.tokens, item.texts))
        return item.tokens + (2 if token in self._wraps else 0)

    def _timed_runs(self, token: int, count: int, texts: tuple[str, ...]) -> np.ndarray:
        """``start, (text, start, count / len(texts) x token, end) per text, end``: a
        Qwen3-VL video as its processor writes it (the template's wrap around the clip, a
        timestamp and a wrap per temporal patch)."""
        start, end = self._wraps[token]
        if count % len(texts):
            raise ValueError(f"{count} placeholders do not split into {len(texts)} equal runs")
        run = [start, *[token] * (count // len(texts)), end]
        ids = [start]
        for text in texts:
            if text not in self._run_text_ids:
                self._run_text_ids[text] = self._plain_backend.encode(
                    text, add_special_tokens=False).ids
            ids += self._run_text_ids[text] + run
        ids.append(end)
        return np.array(ids, dtype=np.int64)

    def markers(self, tokens: TokenBatch, item_tokens: list[Sequence[ItemTokens]],
                failed: dict[int, TextError]
                ) -> tuple[np.ndarray, list[int], list[int], list[tuple[str, ...]]]:
        """Positions of the marker (and modality) tokens, each one's item token count,
        modality token and run texts; texts with a literal modality token or markers that are
        not their items' go to ``failed`` (their markers then keep count 1)."""
        marker_at = np.flatnonzero(self._token_kind[tokens.ids])
        found = tokens.ids[marker_at].tolist()
        cuts = np.searchsorted(marker_at, tokens.bounds).tolist()
        counts, modality_tokens = [1] * len(found), list(found)
        texts: list[tuple[str, ...]] = [()] * len(found)
        for j, items in enumerate(item_tokens):
            a, b = cuts[j], cuts[j + 1]
            if a == b and not items:
                continue
            markers = [self._marker_ids.get(token) for token in found[a:b]]
            expected = [item.modality for item in items]
            if None in markers:
                failed[j] = TextError("literal_special_token", "the text contains a modality "
                                      "token typed literally; remove it from the source text")
            elif markers != expected:
                failed[j] = TextError("template_mismatch", f"the rendered text has markers "
                                      f"{markers}, the sample's media are {expected}")
            else:
                counts[a:b] = [item.tokens for item in items]
                texts[a:b] = [item.texts for item in items]
                modality_tokens[a:b] = [self.modality_token_ids[m] for m in markers]
        return marker_at, counts, modality_tokens, texts

