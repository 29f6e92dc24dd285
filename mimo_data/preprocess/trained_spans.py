"""Trained character spans of rendered texts → which of their tokens are trained."""

from __future__ import annotations

import numpy as np

from typing import NamedTuple

from mimo_data.preprocess.chat_render import TextError, TrainedSpan


class TokenMask(NamedTuple):
    """Which tokens of the texts are trained, and where an EOS token is appended."""
    trained: np.ndarray       # [N] bool, per token
    eos_at: np.ndarray        # int64, sorted: token positions an appended EOS goes before
    eos_texts: np.ndarray     # int64: the text each appended EOS ends an answer of


class TrainedSpans:
    """The trained character spans of several texts, in the concatenation of the texts."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.texts: list[int] = []
        self.eos_after: list[bool] = []

    def add(self, text: int, offset: int, spans: list[TrainedSpan]) -> None:
        for start, end, eos_after in spans:
            self.starts.append(offset + start)
            self.ends.append(offset + end)
            self.texts.append(text)
            self.eos_after.append(eos_after)

    def inside(self, offsets: np.ndarray, text: str, text_starts: list[int],
               failed: dict[int, TextError]) -> TokenMask:
        """Per token (character ``offsets`` [N, 2] into ``text``, in text order): inside one of
        the sorted, disjoint spans? Empty tokens never are. A span followed by an appended EOS
        gets it right after its last token.

        A token reaching into a span from before it is left untrained when what it covers of
        the span is whitespace (an answer starting with a newline merges with the header's
        newline), and trained when what it covers before the span is whitespace (the answer's
        first word with the space after LLaVA-1.5's ``ASSISTANT:``: the token the model
        predicts there); any other partial overlap makes the mask ambiguous: a TextError in
        ``failed`` for that span's text (``text_starts``: where each text starts).
        """
        if not self.starts or not len(offsets):
            nothing = np.zeros(0, dtype=np.int64)
            return TokenMask(np.zeros(len(offsets), dtype=bool), nothing, nothing)
        token_start, token_end = offsets[:, 0], offsets[:, 1]
        starts, ends = np.array(self.starts), np.array(self.ends)
        firsts = np.searchsorted(token_end, starts, side="right")
        stops = np.searchsorted(token_start, ends, side="left")
        last = len(offsets) - 1
        entering = (firsts < stops) & (token_start[np.minimum(firsts, last)] < starts)
        for k in np.flatnonzero(entering).tolist():
            start, end, reach = self.starts[k], self.ends[k], int(token_end[firsts[k]])
            entry = int(token_start[firsts[k]])
            if reach <= end and text[start:reach].isspace():
                firsts[k] += 1
            elif not text[entry:start].isspace():
                self._crossing(k, entry, reach, text, text_starts, failed)
        leaving = (firsts < stops) & (token_end[np.maximum(stops - 1, 0)] > ends)
        for k in np.flatnonzero(leaving).tolist():
            self._crossing(k, int(token_start[stops[k] - 1]), int(token_end[stops[k] - 1]),
                           text, text_starts, failed)
        kept = firsts < stops
        edges = (np.bincount(firsts[kept], minlength=len(offsets) + 1) -
                 np.bincount(stops[kept], minlength=len(offsets) + 1))
        appended = np.array(self.eos_after, dtype=bool)
        return TokenMask((np.cumsum(edges[:-1]) > 0) & (token_start < token_end),
                         stops[appended].astype(np.int64),
                         np.array(self.texts, dtype=np.int64)[appended])

    def _crossing(self, k: int, a: int, b: int, text: str, text_starts: list[int],
                  failed: dict[int, TextError]) -> None:
        owner = self.texts[k]
        origin = text_starts[owner]
        failed.setdefault(owner, TextError(
            "template_mismatch", f"token {text[a:b]!r} at characters {a - origin}-{b - origin} "
            f"crosses the edge of a trained span ({self.starts[k] - origin}-"
            f"{self.ends[k] - origin}); the loss mask would be ambiguous"))

