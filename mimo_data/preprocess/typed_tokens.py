"""Control tokens typed in a record's text.

A tokenizer encodes a special token's text as that token wherever it appears (transformers'
tokenizers too, unless ``split_special_tokens``): a conversation quoting ``<|im_end|>`` gets a
turn end the template did not write, and an answer holding ``<|endoftext|>`` teaches the model
to stop there. The tokens that delimit what mimo writes (the special tokens the chat template
writes, the config's media wrap tokens, and the tokenizer's BOS, EOS, pad and unknown tokens)
are refused in a record's texts
(``literal_special_token``, naming the token and the message). Other special tokens are data
(Qwen-VL's grounding ``<|box_start|>`` ... ``<|box_end|>``) and encode as their tokens. The
media markers (``<image>``) are mimo's own and stay.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from mimo_data.modalities import MARKERS
from mimo_data.preprocess.chat_render import TextError


def delimiter_tokens(tokenizer, template: str | None, wraps: Iterable[str] = ()) -> set[str]:
    """The special tokens of ``tokenizer`` that delimit turns, texts or media: those the chat
    ``template`` writes, the media's ``wraps`` (the config's ``modalities.NAME.wrap``: written
    around each item whatever the template), and the BOS, EOS, pad and unknown tokens; not
    the media markers."""
    special = {token.content for token in tokenizer.added_tokens_decoder.values()
               if token.special}
    named = {str(getattr(tokenizer, name, None))
             for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    written = {token for token in special if template is not None and token in template}
    return (written | (named & special) | (set(wraps) & special)) - set(MARKERS.values())


class TypedTokens:
    """Finds a delimiter token typed in a record's texts."""

    def __init__(self, tokens: Iterable[str]):
        ordered = sorted(tokens, key=len, reverse=True)      # the longest of overlapping ones
        self._search = re.compile("|".join(map(re.escape, ordered))).search if ordered else None

    def error(self, texts: Iterable[tuple[str, str]]) -> TextError | None:
        """The TextError of the first ``(where, text)`` holding a delimiter token, or None."""
        if self._search is None:
            return None
        for where, text in texts:
            found = self._search(text) if isinstance(text, str) else None
            if found is not None:
                return TextError("literal_special_token", f"{where} holds {found[0]!r}, a "
                                 "token the template, the tokenizer or a medium's wrap "
                                 "delimits texts with, typed as text (it would be encoded as "
                                 "that token); remove or rewrite it in the source data")
        return None
