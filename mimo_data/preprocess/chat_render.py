"""Conversation → text and its trained character spans, with the chat template (``chat`` mode) or
plain concatenation (``caption`` mode); media markers stay in the text.

The trained spans come from the template itself: its ``{% generation %}`` blocks when it has
them, otherwise incremental rendering (the text an assistant turn adds after the generation
prompt). Each span runs to its end-of-turn token, inclusive; a span the template writes no
such token in (llava-hf's blocks) starts where the generation prompt before it ends, over the
whitespace between them (what the model writes first at inference); where the template writes
none and
``append_eos`` is on (``end_of_turn``), to the answer's end, and the EOS token is appended
after it. A template that does not re-render the same prefix is an error naming the sample,
never a silently wrong mask; one that trains an answer's turn without the answer (stand-in
conversations tell) is refused when the renderer is made.

Incremental rendering costs one render per assistant turn and one more per turn before it, so
it runs once per conversation *shape* (its roles), on a skeleton whose contents are
placeholders; a sample then renders once, and its text must equal the skeleton with its
contents filled in (the template inserted every content verbatim, once), which makes its spans
the skeleton's (a template that does so for the whole conversation is taken to do so for its
prefixes too). Otherwise, e.g. for a template that trims or branches on contents, the sample
takes the per-sample incremental path. When ``template_contents`` proves from the template's
syntax that it outputs contents as they are, a sample is not rendered at all: its text is the
filled skeleton.

A conversation that uses tools (an answer's calls, tools' turns, the tools on its first
message: ``shards.format.Message``) renders on its own with its tools (``tools=``, as
transformers' ``apply_chat_template``), its calls varying beside its contents; where the
template writes no calls, tools or tools' turns (``tool_support``) it is a ``tool_use``
TextError, never trained without them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jinja2
from transformers.utils.chat_template_utils import (_compile_jinja_template,
                                                   render_jinja_template)

from mimo_data.errors import ConfigError
from mimo_data.modalities import MARKERS
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.end_of_turn import (EosAppending, answer_endings, caption_appending,
                                              end_tokens, eos_appending, turn_end)
from mimo_data.preprocess.template_contents import contents_inserted_verbatim
from mimo_data.preprocess.templates import with_generation
from mimo_data.preprocess.tokenizer_loading import added_bos, chat_template
from mimo_data.shards.format import in_loss
from mimo_data.tally import CountedError

_GENERATION_BLOCK = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")
# Placeholder for the content of message k in a skeleton render (private-use code points).
_SLOT = "\ue000{}\ue001"
_SLOT_PATTERN = re.compile("\ue000([0-9]+)\ue001")
_MAX_SKELETONS = 256
# A conversation that uses tools, with a stand-in name for each part of tool use
# (``ChatRenderer.tool_support``); its call's id is 9 letters, which Mistral's templates demand
_TOOL_STAND_INS = {"tool calls": "mimo_probe_call", "tool lists": "mimo_probe_tool",
                   "tools' turns": "mimo_probe_result"}
_TOOL_PROBE = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "mimoprobe",
                                                         "function": {
        "name": _TOOL_STAND_INS["tool calls"], "arguments": {"x": 1}}}]},
    {"role": "tool", "content": _TOOL_STAND_INS["tools' turns"], "tool_call_id": "mimoprobe",
     "name": "mimo_probe_named"},
    {"role": "assistant", "content": "Done."}]
_TOOL_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _TOOL_STAND_INS["tool lists"], "description": "A tool.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]


class TextError(CountedError):
    """A conversation whose tokens or mask cannot be built; ``reason`` is its report category."""


class TrainedSpan(NamedTuple):
    """Characters of a rendered text the loss covers (an answer through its end of turn)."""
    start: int
    end: int
    eos_after: bool       # the EOS token is appended after the span's tokens (append_eos)


@dataclass(frozen=True)
class _Skeleton:
    """A conversation shape rendered with placeholder contents: the text is ``parts[0]``, the
    content of message ``order[0]``, ``parts[1]``, ...; trained spans as (part, offset) pairs."""
    parts: tuple[str, ...]
    order: tuple[int, ...]
    spans: tuple[tuple[tuple[int, int], tuple[int, int]], ...]

    def fill(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The skeleton's text and spans with ``messages``' contents in place."""
        contents = [messages[k]["content"] for k in self.order]
        pieces, starts, position = [self.parts[0]], [0], len(self.parts[0])
        for content, part in zip(contents, self.parts[1:]):
            position += len(content)
            starts.append(position)
            position += len(part)
            pieces += (content, part)
        return "".join(pieces), [(starts[a] + i, starts[b] + j)
                                 for (a, i), (b, j) in self.spans]


class ChatRenderer:
    """Renders conversations for one config and tokenizer (``mode: chat`` or ``caption``)."""

    def __init__(self, config: PreprocessConfig, tokenizer):
        self.config = config
        self.eot = self._eos = tokenizer.eos_token
        if self.eot is None:
            raise ValueError(f"tokenizer {config.tokenizer!r} has no eos token to end turns with")
        self.template: str | None = None
        self._tool_support: frozenset[str] | None = None
        self._tool_probe_error: str | None = None
        self.has_generation_blocks = False
        self.generation_prompt = ""
        self.part_joiner = "\n"            # caption mode joins the turns with newlines too
        self.contents_verbatim = True       # caption mode joins the contents as they are
        self.eos_appending: EosAppending = caption_appending(config.append_eos, self.eot)
        if config.mode == "chat":
            # a published template mimo copies with generation blocks: that copy (the same
            # text), so every turn's loss is placed
            self.template = template = with_generation(chat_template(config, tokenizer))
            self.has_generation_blocks = bool(_GENERATION_BLOCK.search(template))
            self.template_kwargs = dict(tokenizer.special_tokens_map)
            # transformers' own compiled (cached) template: render_jinja_template's per-call
            # conversion of the messages costs a third of each render; ours are plain dicts.
            try:
                self._compiled = _compile_jinja_template(template)
            except jinja2.TemplateError as exc:
                where = f" line {exc.lineno}" if isinstance(
                    exc, jinja2.TemplateSyntaxError) else ""
                raise ConfigError(
                    ("the configured chat_template" if config.chat_template else
                     f"tokenizer {config.tokenizer!r}'s chat template") +
                    f" is not a template Jinja reads ({type(exc).__name__}{where}: {exc}): "
                    "mend it (a {% generation %} block must open and close within the same "
                    "{% if %} or {% for %} branch)" + (
                        ", or leave chat_template out to use the tokenizer's own"
                        if config.chat_template else ", or give one as chat_template")) from None
            self._skeletons: dict[tuple[str, ...], _Skeleton | None] = {}
            # Proven from the template's syntax: a conversation's text is its skeleton filled
            # with the contents, so jinja runs once per role shape instead of once per sample.
            self.contents_verbatim = (not self.has_generation_blocks and
                                      contents_inserted_verbatim(self._compiled.environment,
                                                                 template))
            # A template that renders contents only from typed parts (llava-hf's: a message's
            # images, then its text) gets each content as those parts (``typed_parts``), but
            # for the roles it writes a plain string of (``_plain_roles``)
            self.typed_contents = self._takes_typed_contents()
            self.plain_roles = self._plain_roles() if self.typed_contents else frozenset()
            # the BOS a tokenizer puts before every text it encodes (LLaMA's <s>) where the
            # template does not write it: the published processors encode the chat with it
            self.bos_text = added_bos(tokenizer)
            self.generation_prompt = self._generation_prompt()
            self.part_joiner = self._part_joiner()
            modality_tokens = {m.token for m in config.modalities.values()}
            endings = answer_endings(self._render)
            ends = end_tokens(tokenizer, modality_tokens | set(MARKERS.values()))
            # what may follow an answer in its span: the end tokens, the padding token
            # (Llama-3's <|eot_id|> as a base tokenizer's pad) and any other added token (a
            # ChatML <|im_end|> added as a plain one), but the modality tokens
            self._end_tokens = [*ends, *(token.content for token in
                                         tokenizer.added_tokens_decoder.values()
                                         if token.content not in modality_tokens
                                         and token.content not in MARKERS.values())]
            self.eos_appending = eos_appending(config.append_eos, self.eot, endings, ends)
            if config.append_eos is not True:      # true: the EOS after every answer
                # answers are trained through the token the template ends them with
                self.eot = turn_end(endings, ends) or self.eot
            self._check_answers_written()

    def render(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[TrainedSpan]]:
        """The text and its trained character spans (each ending with the end-of-turn token,
        or followed by an appended EOS); an answer with ``"weight": 0`` is in the text, not in
        the spans."""
        tools = self._tool_use(messages)
        if self.config.mode == "caption":
            text, answers = self._render_caption(messages)
            return text, _weighed(messages, answers)
        if self.has_generation_blocks:
            text, spans = self._render_with_generation_spans(messages, tools)
        elif tools is not None:     # calls and tools vary beside the contents: no skeleton
            text = self._render(messages, tools=tools)
            spans = self._incremental_spans(messages, text, tools)
        else:
            skeleton = self._skeleton(tuple(message["role"] for message in messages))
            filled = skeleton.fill(messages) if skeleton is not None else None
            if filled is not None and self.contents_verbatim:
                text, spans = filled
            else:
                text = self._render(messages)
                if filled is not None and filled[0] == text:
                    spans = filled[1]
                else:
                    spans = self._incremental_spans(messages, text)
        trained = [self._through_eot(text, start, end) for start, end in
                   _weighed(messages, spans)]
        bos = self._bos(text)
        if not bos:         # most tokenizers: no second span object per span (every sample)
            return text, trained
        return bos + text, [TrainedSpan(start + len(bos), end + len(bos), eos_after)
                            for start, end, eos_after in trained]

    def render_prompt(self, messages: Sequence[Mapping[str, Any]],
                      template_options: Mapping[str, Any] | None = None) -> str:
        """The text of a conversation for the model to continue: with the template's generation
        prompt (``caption`` mode: the turns joined by newlines, then the newline an answer
        follows); ``template_options``: more variables for the template (Qwen's
        ``enable_thinking``)."""
        tools = self._tool_use(messages)
        if self.config.mode == "caption":
            return self._render_caption(messages)[0] + "\n"
        text = self._render(messages, generation_prompt=True, tools=tools,
                            options=template_options)
        return self._bos(text) + text

    def _bos(self, text: str) -> str:
        return "" if text.startswith(self.bos_text) else self.bos_text

    def _probe(self, content, generation_prompt: bool = False,
               before: Sequence[Mapping[str, Any]] = (), role: str = "user") -> str | None:
        """The template's render of ``before``, then a ``role`` message of ``content`` as given
        (a string or typed parts), or None where it refuses it (its own raise_exception(),
        jinja errors)."""
        try:
            return self._compiled.render(
                messages=[*before, {"role": role, "content": content}], tools=None,
                documents=None, add_generation_prompt=generation_prompt, **self.template_kwargs)
        except Exception:  # a template that refuses the probe: no evidence either way
            return None

    def _takes_typed_contents(self) -> bool:
        """Whether the template drops a plain string content but writes a typed text part."""
        probe = "\ue002probe\ue003"
        return probe not in (self._probe(probe) or "") and \
            probe in (self._probe([{"type": "text", "text": probe}]) or "")

    def _writes_no_answer(self, probe: list[dict]) -> bool:
        """Whether the template renders ``probe`` without its stand-in answer (False where it
        fails on it: no evidence)."""
        try:
            return _ANSWER_PROBE not in self._render(probe)
        except TextError:
            return False

    def _plain_roles(self) -> frozenset[str]:
        """The roles a template of typed user contents writes a plain string content of (one
        that iterates a user's parts but writes ``message['content']`` of an answer, which
        would otherwise train the parts' Python text)."""
        probe = "\ue002probe\ue003"
        user = {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
        return frozenset(role for role, before in (("system", ()), ("assistant", (user,)))
                         if probe in (self._probe(probe, before=before, role=role) or ""))

    def _check_answers_written(self) -> None:
        """ConfigError where the template trains an answer's turn without the answer (it reads
        ``message['text']``, or typed parts of answers given as strings; its generation blocks
        hold the end of turn alone): every answer would train its end of turn alone, or other
        text after it than end-of-turn tokens. Read from stand-in conversations (one answer; a
        system turn and two answers); one the template fails on is no evidence."""
        answer = {"role": "assistant", "content": _ANSWER_PROBE}
        for probe in ([{"role": "user", "content": "Hi"}, answer],
                      [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Hi"}, answer,
                       {"role": "user", "content": "And?"}, answer]):
            try:
                text, spans = self.render(probe)
            except TextError:
                if self._writes_no_answer(probe):
                    raise ConfigError(
                        ("the configured chat_template" if self.config.chat_template else
                         f"tokenizer {self.config.tokenizer!r}'s chat template") +
                        f" writes no answer (a stand-in answer {_ANSWER_PROBE!r} is not in its "
                        "render of a conversation): nothing of any sample could be trained; "
                        "give a chat_template that writes the assistant's turns" +
                        (", or leave chat_template out to use the tokenizer's own"
                         if self.config.chat_template else "")) from None
                continue
            trained = [text[span.start:span.end] for span in spans]
            written = [piece for piece in trained if _ANSWER_PROBE in piece]
            # after an answer: its end-of-turn tokens and whitespace alone (Phi-3's <|end|>
            # then the EOS ending the text; ChatML's <|im_end|> where the EOS is appended)
            wrong = next((piece for piece in written
                          if _without(piece.rpartition(_ANSWER_PROBE)[2], self._end_tokens)
                          .strip()), None)
            # before an answer: never the generation prompt (a {% generation %} block opened
            # before the role header would train <|im_start|>assistant, the prompt's tokens)
            prompt = self.generation_prompt.strip()
            if wrong is None and prompt:
                wrong = next((piece for piece in written
                              if prompt in piece.partition(_ANSWER_PROBE)[0]), None)
            if wrong is None and len(written) == sum(m["role"] == "assistant" for m in probe):
                continue
            shown = wrong if wrong is not None else next(
                (piece for piece in trained if _ANSWER_PROBE not in piece), "")
            why = ("its {% generation %} blocks hold the answer's end but not its content: "
                   "put the content inside them" if wrong is None and _ANSWER_PROBE in text
                   else "its {% generation %} blocks hold the generation prompt (the role "
                   "header) the model is given, not only what it writes: open them after it"
                   if wrong is not None and prompt and prompt in wrong.partition(
                       _ANSWER_PROBE)[0]
                   else "does it read message['text'] or typed parts where a message's content "
                   "is message['content'], a string? Mend it")
            raise ConfigError(
                ("the configured chat_template" if self.config.chat_template else
                 f"tokenizer {self.config.tokenizer!r}'s chat template") +
                " does not train an answer's content as the answer (a stand-in answer "
                f"{_ANSWER_PROBE!r} trains {shown!r}): every answer would train " +
                ("other text" if wrong is not None else "its end of turn alone") +
                f"; {why}" + (", or leave chat_template out to use the tokenizer's own"
                              if self.config.chat_template else ", or give one as "
                              "chat_template"))

    def _generation_prompt(self) -> str:
        """What the template writes to prompt an answer (``add_generation_prompt``), read from
        a probe conversation; "" where it writes none or fails on the probe."""
        content = self._for_template([{"role": "user", "content": "probe"}])[0]["content"]
        without, prompted = (self._probe(content, flag) for flag in (False, True))
        if without is None or prompted is None or not prompted.startswith(without):
            return ""
        return prompted[len(without):]

    def _part_joiner(self) -> str:
        """What the template writes between two adjacent text parts of a content (nothing in
        Qwen's, a space in LLaVA-1.5's, a newline in llava-interleave's), read from a probe; a
        newline where what it writes there is not whitespace alone (a template of string
        contents only writes the list as it is) or it fails on the probe."""
        first, second = "\ue002first\ue003", "\ue002second\ue003"
        text = self._probe([{"type": "text", "text": first}, {"type": "text", "text": second}])
        _, found, after = (text or "").partition(first)
        between, found_second, _ = after.partition(second)
        return between if found and found_second and not between.strip() else "\n"

    def _for_template(self, messages):
        if not self.typed_contents:
            return messages
        return [m if m["role"] in self.plain_roles else {**m, "content": typed_parts(m["content"])}
                for m in messages]

    def _tool_use(self, messages) -> list[dict] | None:
        """The tools to render a conversation with (``[]`` where it lists none), None where it
        uses no tool; TextError (``tool_use``) where the template writes no part of the tool
        use it holds (its calls, its tools or its tools' turns: ``tool_support``)."""
        tools = messages[0].get("tools") if messages else None
        # one pass over the messages: this runs for every sample
        used = [message for message in messages
                if message["role"] == "tool" or "tool_calls" in message]
        if not (tools or used):
            return None
        calls = any(message.get("tool_calls") for message in used)
        results = any(message["role"] == "tool" for message in used)
        writes = self.tool_support()
        missing = [what for what, used in (("tool calls", calls), ("tool lists", tools),
                                           ("tools' turns", results))
                   if used and what not in writes]
        if missing:
            why = ("caption mode has no template" if self.template is None else
                   f"it fails on a conversation that uses them: {self._tool_probe_error}"
                   if self._tool_probe_error else
                   "give a chat_template that writes tool use: for a Qwen model, Qwen3-VL's "
                   "or Qwen3.5's, whose <tool_call> turns Qwen2.5-Instruct's write too")
            raise TextError("tool_use", f"the conversation uses tools but the chat template "
                            f"writes no {' and no '.join(missing)} ({why}, or leave such "
                            "records out)")
        return tools or []

    def tool_support(self) -> frozenset[str]:
        """What of tool use the template writes: ``tool calls``, ``tool lists``, ``tools'
        turns``; read from a render of a conversation that uses each, with stand-in names."""
        if self._tool_support is None:
            written = ""
            if self.template is not None:
                try:
                    written = self._render(_TOOL_PROBE, tools=_TOOL_PROBE_TOOLS)
                except TextError as exc:
                    self._tool_probe_error = exc.detail
            self._tool_support = frozenset(what for what, stand_in in _TOOL_STAND_INS.items()
                                           if stand_in in written)
        return self._tool_support

    def unwritten_modalities(self) -> list[str]:
        """The modalities whose marker (``<audio>``) the template does not write for a message
        holding one (llava-hf's write a message's images and text only): every sample with one
        would be dropped as ``template_mismatch``. Read from a probe message per modality; one
        the template fails on is not counted."""
        unwritten = []
        for modality, marker in MARKERS.items():
            try:
                text = self.render_prompt([{"role": "user", "content": f"{marker}\nWhat is it?"}])
            except TextError:           # a template that refuses the probe: no evidence
                continue
            if marker not in text:
                unwritten.append(modality)
        return unwritten

    def _render(self, messages, generation_prompt=False, tools=None, options=None):
        messages = self._for_template(messages)
        try:
            return self._compiled.render(messages=messages, tools=tools or None, documents=None,
                                         add_generation_prompt=generation_prompt,
                                         **{**self.template_kwargs, **(options or {})})
        except Exception as exc:  # the template's own raise_exception(), jinja errors
            raise TextError("template_error", f"the chat template failed: {exc}") from None

    def _render_with_generation_spans(self, messages, tools=None):
        try:
            rendered, spans = render_jinja_template(
                [self._for_template(messages)], tools=tools or None,
                chat_template=self.template, return_assistant_tokens_mask=True,
                **self.template_kwargs)
        except Exception as exc:
            raise TextError("template_error", f"the chat template failed: {exc}") from None
        return rendered[0], spans[0]

    def _incremental_spans(self, messages, text, tools=None):
        """Per assistant turn, the characters it adds to ``text`` (the conversation's render)
        after the generation prompt; TextError if the template re-renders earlier turns."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = (self._render(messages[:i], generation_prompt=True, tools=tools) if i
                      else self._opening_prompt(message, tools))
            after = text if i == len(messages) - 1 else self._render(messages[:i + 1],
                                                                     tools=tools)
            if i == 0 and not after.startswith(before):
                before = self._opening_prefix(message, before, tools) or before
            # a template that ends the whole text with the EOS (Phi-3's, where no answer is
            # prompted): the turn is its render less that EOS
            if not text.startswith(after) and after.endswith(self._eos) and \
                    text.startswith(after[:len(after) - len(self._eos)]):
                after = after[:len(after) - len(self._eos)]
            if not (after.startswith(before) and text.startswith(after)):
                # a stand-in answer the template does not write: it leaves the answers out
                if _ANSWER_PROBE not in self._render(
                        [*messages[:i], {**message, "content": _ANSWER_PROBE}], tools=tools):
                    raise TextError("template_mismatch", f"the chat template does not write "
                                    f"turn {i}'s answer at all (it leaves the assistant's "
                                    "turns out?): nothing of it could be trained; give a "
                                    "chat_template that writes the answers, or leave "
                                    "chat_template out to use the tokenizer's own")
                first = not any(m["role"] == "user" for m in messages[:i])
                raise TextError("template_mismatch", f"the chat template does not render "
                                f"turn {i} as an extension of the turns before it, so the "
                                "assistant span cannot be located; " + (
                                    "it is an assistant turn with no user turn before it, "
                                    "and the template renders what comes before it "
                                    "differently on its own than within the conversation (a "
                                    "default system prompt added once there are turns?): "
                                    "start the conversation with a user turn (or a system "
                                    "turn)" if first else _rewritten(before, after, text)))
            spans.append((len(before), len(after)))
        return spans

    def _opening_prompt(self, message: dict, tools: list | None) -> str:
        """The generation prompt before a conversation's opening answer: the template's render
        of no turns, or, for a template that fails on none (Qwen3-VL's reads
        ``messages[0]``), what it writes before the answer where that ends with its
        generation prompt; else the template's error."""
        try:
            return self._render([], generation_prompt=True, tools=tools)
        except TextError:
            prefix = (self._opening_prefix(message, self.generation_prompt, tools)
                      if self.generation_prompt else None)
            if prefix is None:
                raise
            return prefix

    def _opening_prefix(self, message, prompt: str, tools) -> str | None:
        """What a conversation that opens with an assistant turn (a greeting) renders before
        its answer, where that ends with the generation prompt ``prompt`` (the template's
        render of no turns) and the template writes more before it once there are turns (the
        default system prompt of Qwen2-VL's and SmolLM2's templates); else None."""
        probe = self._render([{**message, "content": _ANSWER_PROBE}], tools=tools)
        prefix, found, _ = probe.partition(_ANSWER_PROBE)
        return prefix if found and prefix.endswith(prompt) else None

    def _skeleton(self, roles: tuple[str, ...]) -> _Skeleton | None:
        """The skeleton of conversations with these roles (None: the template does not insert
        each content once, or fails on placeholders: every sample renders incrementally)."""
        if roles in self._skeletons:
            return self._skeletons[roles]
        if len(self._skeletons) >= _MAX_SKELETONS:
            self._skeletons.clear()
        self._skeletons[roles] = skeleton = self._build_skeleton(roles)
        return skeleton

    def _build_skeleton(self, roles: tuple[str, ...]) -> _Skeleton | None:
        messages = [{"role": role, "content": _SLOT.format(k)} for k, role in enumerate(roles)]
        try:
            text = self._render(messages)
            spans = self._incremental_spans(messages, text)
        except TextError:
            return None
        pieces = _SLOT_PATTERN.split(text)
        parts, order = tuple(pieces[0::2]), tuple(int(k) for k in pieces[1::2])
        if sorted(order) != list(range(len(roles))):
            return None
        slots = [len(_SLOT.format(k)) for k in order]
        ends = [_part_offset(position, parts, slots) for span in spans for position in span]
        if None in ends:
            return None
        return _Skeleton(parts, order, tuple(zip(ends[0::2], ends[1::2])))

    def _through_eot(self, text: str, start: int, end: int) -> TrainedSpan:
        # Train up to and including the end-of-turn token; what the template adds after it
        # (a newline before the next turn) is not something the model must generate.
        stop = text.rfind(self.eot, start, end)
        if stop != -1:
            return TrainedSpan(start, stop + len(self.eot), False)
        append = self.eos_appending.on
        if not (self.has_generation_blocks or append):
            raise TextError("template_mismatch", f"an assistant turn does not end with the "
                            f"end-of-turn token {self.eot!r}: {text[start:end][-60:]!r} (with "
                            "append_eos: true the EOS is appended after each answer)")
        # The assistant's text (a {% generation %} block's, or what the turn adds) from the end
        # of the generation prompt before it (what the model writes first at inference: the
        # space after LLaVA-1.5's "ASSISTANT:", the newline llava-interleave's blocks open
        # with; a token that merges it with the prompt's own, as Qwen's tokenizer merges two
        # newlines, stays untrained: ``trained_spans``), without the template's whitespace
        # after it, and the end-of-turn token right after it if the template writes one there
        # (llava-hf's Qwen template); else the appended EOS, if on (LLaVA-1.5's turns end with
        # a space). An empty answer's span is empty.
        inner = text[start:end]
        if not inner.strip():
            start = end = start + len(inner)
        else:
            end -= len(inner) - len(inner.rstrip())
            start = self._prompt_end(text, start + len(inner) - len(inner.lstrip()))
        if text.startswith(self.eot, end):
            return TrainedSpan(start, end + len(self.eot), False)
        return TrainedSpan(start, end, append)

    def _prompt_end(self, text: str, start: int) -> int:
        """Where the generation prompt before an answer starting at ``start`` ends, where only
        whitespace lies between them; else ``start``."""
        prompt = self.generation_prompt
        if not prompt:
            return start
        # the prompt may end in whitespace (llava-interleave's newline), so it is looked for
        # among the last characters before the whitespace preceding the answer
        spaced = start
        while spaced > 0 and text[spaced - 1].isspace():
            spaced -= 1
        found = text.rfind(prompt, max(0, spaced - len(prompt)), start)
        if found >= 0 and not text[found + len(prompt):start].strip():
            return found + len(prompt)
        return start

    def _render_caption(self, messages) -> tuple[str, list[TrainedSpan]]:
        # Caption mode: no template; turns joined by newlines, each assistant text followed by
        # the eos token; the loss covers the assistant texts and their eos tokens.
        parts: list[str] = []
        spans: list[TrainedSpan] = []
        position = 0
        for message in messages:
            if parts:
                parts.append("\n")
                position += 1
            piece = message["content"]
            if message["role"] == "assistant":
                piece += self.eot
                spans.append(TrainedSpan(position, position + len(piece), False))
            parts.append(piece)
            position += len(piece)
        return "".join(parts), spans


def _without(text: str, tokens: Sequence[str]) -> str:
    """``text`` with every one of ``tokens`` taken out."""
    for token in tokens:
        text = text.replace(token, "")
    return text


def _rewritten(before: str, after: str, text: str) -> str:
    """How a template writes an answer's turn otherwise than its prefixes say, and what to do:
    ``before``, the render up to it with the generation prompt; ``after``, up to it and with
    it; ``text``, the whole conversation's."""
    prompted = not after.startswith(before)
    shorter, longer = (before, after) if prompted else (after, text)
    at = next((k for k, (a, b) in enumerate(zip(shorter, longer)) if a != b),
              min(len(shorter), len(longer)))
    # shown from the start of the token or line they part in (within 40 characters)
    start = max(shorter.rfind("<", 0, at + 1), shorter.rfind("\n", 0, at) + 1, at - 40, 0) \
        if "<" in shorter[max(0, at - 40):at + 1] or "\n" in shorter[max(0, at - 40):at] else at
    first, second = shorter[start:at + 40], longer[start:at + 40]
    thinking = " (an empty think block on the last answer alone, as Qwen3's template " \
        "writes?)" if "<think>" in first + second else ""
    said = (f"the turns before it, rendered with the generation prompt, end {first!r}, "
            f"followed by it {second!r}" if prompted else
            f"where the conversation ends with it the template writes {first!r}, where later "
            f"turns follow {second!r}{thinking}")
    return (f"{said}: give a chat_template with {{% generation %}} blocks around what each "
            "answer writes (mimo's copy of Qwen3.5's, mimo_data/preprocess/templates/"
            "qwen3_5.jinja, is one), or one record per answer")


def _weighed(messages: Sequence[Mapping[str, Any]], spans: list) -> list:
    """The spans of the answers in the loss: ``spans`` are the answers' (one each, in order),
    less those with ``"weight": 0``."""
    trained = [in_loss(message) for message in messages if message["role"] == "assistant"]
    if all(trained):
        return spans
    if len(trained) != len(spans):
        answers = [message for message in messages if message["role"] == "assistant"]
        blank = [k for k, answer in enumerate(answers) if not answer.get("tool_calls") and (
            not answer["content"] or isinstance(answer["content"], str)
            and not answer["content"].strip())]
        raise TextError("template_mismatch", f"the chat template writes {len(spans)} answer "
                        f"span(s) for {len(trained)} answers, so the answers with weight 0 "
                        "cannot be left out of the loss: " + (
                            f"answer {blank[0] + 1} is empty, and the template writes no "
                            "{% generation %} block for an empty answer: give it text, or "
                            "leave the turn out" if blank else
                            "give it one {% generation %} block an answer"))
    return [span for span, kept in zip(spans, trained) if kept]


# a stand-in answer's text: a template that writes answers writes it (``_incremental_spans``)
_ANSWER_PROBE = "mimo's stand-in answer"
_MARKER_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS.values()) + ")")
_MODALITY_OF = {marker: modality for modality, marker in MARKERS.items()}


def typed_parts(content: str) -> list[dict]:
    """A content as typed parts, in its order: ``{"type": modality}`` per marker and
    ``{"type": "text", "text": ...}`` for the text between markers, stripped of the whitespace
    next to a marker (an image marker, a newline and a question: an image, then the
    question); text with no marker beside it stays as written (an answer's indentation, its
    last newline)."""
    pieces = _MARKER_SPLIT.split(content)
    parts: list[dict] = []
    for k, piece in enumerate(pieces):
        if piece in _MODALITY_OF:
            parts.append({"type": _MODALITY_OF[piece]})
            continue
        if k > 0:                                   # a marker before it
            piece = piece.lstrip()
        if k + 1 < len(pieces):                     # a marker after it
            piece = piece.rstrip()
        if piece.strip():
            parts.append({"type": "text", "text": piece})
    return parts


def _part_offset(position: int, parts: tuple[str, ...], slots: list[int]):
    """(part, offset) of a skeleton character position; None inside a placeholder."""
    start = 0
    for part, text in enumerate(parts):
        if start <= position <= start + len(text):
            return part, position - start
        start += len(text) + (slots[part] if part < len(slots) else 0)
    return None
