"""What of an answer with think tags a chat template writes, read from the template itself.

Templates take an answer holding ``<think>...</think>`` apart in different ways: Qwen3's and
Qwen3.5's write its reasoning in a think block of their own after the last user query and
leave it out before (as at inference); DeepSeek-R1's write the text after the last
``</think>`` alone, in every turn; others write the content as it is. Rather than re-state any
of these rules, a template that mentions ``</think>`` renders once per conversation shape with
each answer's parts as stand-ins (``PARTS``), and the stand-ins that come out say which parts
it writes. The preprocessor's ``empty_answers`` drop and ``mimo-inspect``'s coverage read the
same answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mimo_data.preprocess.chat_render import TextError

THINK_START, THINK_END = "<think>", "</think>"
# An answer's parts, as templates that take it apart split it: before the reasoning (before
# the last <think> ahead of the first </think>), the reasoning (from there to the first
# </think>), the middle (between the </think> tags), the text (after the last)
PARTS = "prma"
REASONING, UNTAKEN = "r", "pm"       # the reasoning; the parts no such template takes

# Answer k with each part a stand-in (private-use code points), and a tool's response (a
# template may tell a user's query from it: Qwen3's last_query_index); any other content k.
_ANSWER = ("\ue000p{0}\ue001<think>\n\ue000r{0}\ue001\n</think>\ue000m{0}\ue001</think>\n\n"
           "\ue000a{0}\ue001")
_TOOL_RESPONSE = "<tool_response>\n\ue000{0}\ue001\n</tool_response>"
_CONTENT = "\ue000{0}\ue001"
_WRITTEN = re.compile("\ue000([prma])([0-9]+)\ue001")
_MAX_SHAPES = 256

Written = Mapping[int, frozenset[str]]      # assistant turn -> the parts the template writes


class AnswerParts:
    """Which parts of each answer a chat template writes, by conversation shape (memoized).

    ``render``: messages -> (text, ...), raising TextError where the template refuses them;
    ``template``: its text (None in caption mode: contents are written as they are)."""

    def __init__(self, render: Callable[[list[dict]], tuple[str, Any]], template: str | None):
        self._render = render
        self._takes_apart = THINK_END in (template or "")
        self._written: dict[tuple, Written | None] = {}

    def written(self, messages: Sequence[Mapping[str, Any]]) -> Written | None:
        """Per assistant turn of ``messages``, the parts (``PARTS``) of a content with think
        tags the template writes; None where no answer holds ``</think>``, the template cannot
        take one apart (it mentions none) or refuses the stand-ins: contents are then taken
        whole."""
        if not (self._takes_apart and any(
                message.get("role") == "assistant" and THINK_END in str(message.get("content"))
                for message in messages)):
            return None
        shape = tuple((str(message.get("role")), _tool_response(message))
                      for message in messages)
        if shape not in self._written:
            if len(self._written) >= _MAX_SHAPES:
                self._written.clear()
            stand_ins = [{"role": role, "content": (
                _ANSWER if role == "assistant" else _TOOL_RESPONSE if tool else _CONTENT
            ).format(k)} for k, (role, tool) in enumerate(shape)]
            try:
                found = _WRITTEN.findall(self._render(stand_ins)[0])
            except TextError:
                found = None
            self._written[shape] = None if found is None else {
                turn: frozenset(part for part, k in found if k == str(turn))
                for turn, (role, _) in enumerate(shape) if role == "assistant"}
        return self._written[shape]


def split_reasoning(content: str) -> tuple[str, str, str, str]:
    """An answer's parts (``PARTS``), each stripped."""
    sections = content.split(THINK_END)
    head, _, reasoning = sections[0].rpartition(THINK_START)
    return head.strip(), reasoning.strip(), " ".join(sections[1:-1]).strip(), sections[-1].strip()


def written_parts(content: str, written: Written | None, turn: int) -> list[str]:
    """What of message ``turn``'s content the template writes, in order: the parts it writes
    of a content with think tags, else the whole content."""
    kept = written.get(turn) if written else None
    if kept is None or THINK_END not in content:
        return [content]
    return [text for part, text in zip(PARTS, split_reasoning(content)) if part in kept]


def empty_answer(message: Mapping[str, Any], written: Written | None, turn: int) -> bool:
    """Whether answer ``turn`` is empty as the template writes it: no text in the parts it
    writes (``written_parts``), no call; its end of turn would be all it trains."""
    return not message.get("tool_calls") and not "".join(
        written_parts(str(message.get("content") or ""), written, turn)).strip()


def unclosed_think(message: Mapping[str, Any]) -> bool:
    """Whether an answer's last ``<think>`` has no ``</think>`` after it: no template takes
    it apart, and its text trains the model to open a think block it never closes."""
    content = str(message.get("content") or "")
    start = content.rfind(THINK_START)
    return start >= 0 and THINK_END not in content[start:]


def _tool_response(message: Mapping[str, Any]) -> bool:
    """A user turn that is a tool's response (``<tool_response>...</tool_response>``), which
    Qwen3's and Qwen3.5's templates do not take for a query."""
    text = str(message.get("content") or "").strip()
    return message.get("role") == "user" and text.startswith("<tool_response>") and \
        text.endswith("</tool_response>")
