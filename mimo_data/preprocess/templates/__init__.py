"""Chat templates mimo ships: a published template with ``{% generation %}`` blocks added around
what each assistant turn writes, where the published one cannot place the loss of every turn
(the text rendered is the published template's, character for character).

A chat renderer given the published text itself (the tokenizer's own, or a ``chat_template:``
file holding it) renders through mimo's copy (``with_generation``): the same text, every
turn's loss placed; a template that differs by a character is the user's, rendered as it is."""

from __future__ import annotations

import hashlib
from pathlib import Path

FOLDER = Path(__file__).parent
# sha256 of Qwen3.5's published template (tools/published/Qwen--Qwen3.5-4B/chat_template.jinja,
# the MoE's the same), which qwen3_5.jinja copies
QWEN3_5_PUBLISHED_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
# a published template's sha256 -> mimo's copy of it with generation blocks
COPIES = {QWEN3_5_PUBLISHED_SHA256: FOLDER / "qwen3_5.jinja"}


def copy_of(template: object) -> Path | None:
    """mimo's copy of ``template`` with ``{% generation %}`` blocks where ``template`` is a
    published one mimo copies, else None (a template of the user's, or none)."""
    if not isinstance(template, str):
        return None
    # Jinja reads a template's line ends as newlines and drops one at its end
    # (keep_trailing_newline is off): a file saved by an editor that adds one, or with Windows'
    # line ends, renders the published text, so it is the same template
    lines = template.replace("\r\n", "\n")
    for text in (template, lines, lines.removesuffix("\n")):
        copy = COPIES.get(hashlib.sha256(text.encode()).hexdigest())
        if copy is not None:
            return copy
    return None


def with_generation(template: str) -> str:
    """``copy_of(template)``'s text (the same text rendered) where there is one, else
    ``template``."""
    copy = copy_of(template)
    return copy.read_text() if copy is not None else template
