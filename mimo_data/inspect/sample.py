"""One sample as training sees it: tokens by class, placeholder counts, media summary.

Token classes: ``trained`` (a target of the loss), ``prompt`` (in the sequence, masked out of
the loss), one class per modality for the placeholder tokens (shown collapsed, e.g.
``<|image_pad|>×64``) and ``padding`` (what the collator adds up to ``seq_length``). Token j is
trained when ``loss_mask[j-1]`` is 1, i.e. when the model is trained to predict it; the last
target of a sample, which is not in ``input_ids``, is shown too.

A dropped sample has no training tokens; it is shown as the text encoder tokenizes it (without
the ``seq_length`` limit) when that is possible, so that one sees why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import cast

import numpy as np

from mimo_data.stats import size_text
from mimo_data.preprocess.chat_tokens import ItemTokens, TextError
from mimo_data.modalities import MODALITIES
from mimo_data.inspect.stats import SampleInspector, SampleStats, expected_item_tokens
from mimo_data.preprocess.preprocessor import Record, Sample
from mimo_data.shards.format import TEXT_PART_BREAK

ANSI = {"trained": "\033[1;32m", "prompt": "\033[37m",
        **{name: m.ansi_color for name, m in MODALITIES.items()}, "padding": "\033[90m"}
ANSI_RESET = "\033[0m"
CLASS_NAMES = {"trained": "trained", "prompt": "prompt (masked)",
               **{name: f"{name} placeholders" for name in MODALITIES}, "padding": "padding"}


@dataclass
class TokenRun:
    """Consecutive tokens of one class: ``text`` is their decoded text (or a collapsed form)."""
    cls: str
    text: str
    count: int
    collapsed: bool = False


@dataclass
class TokenView:
    """A sample's tokens by class, ready to print or to put in HTML."""
    runs: list[TokenRun]
    note: str = ""          # why the tokens differ from a kept sample's, if they do


def _sequence_of(sample: Sample) -> tuple[np.ndarray, np.ndarray]:
    """Full token sequence and per-token "is a target" flags of a kept sample."""
    ids = sample.input_ids.numpy()
    mask = sample.loss_mask.numpy() > 0
    trained = np.concatenate([[False], mask[:-1]]) if len(ids) else np.zeros(0, bool)
    if len(mask) and mask[-1]:               # the last target is not an input token
        ids = np.append(ids, int(sample.labels[-1]))
        trained = np.append(trained, True)
    return ids, trained


def token_view(inspector: SampleInspector, record: Record, stats: SampleStats,
               sample: Sample | None) -> TokenView:
    """The tokens of a sample by class (kept), or as far as they can be built (dropped)."""
    note = ""
    if sample is not None:
        ids, trained = _sequence_of(sample)
    else:
        media = record.get("media") or []
        counts = [expected_item_tokens(item, inspector.config) for item in media]
        if None in counts:
            return _messages_view(record, "no tokens: a media item's token count cannot be "
                                  "computed; the messages as stored")
        try:
            configs = inspector.config.modalities
            items = [ItemTokens(item["modality"], cast(int, n), MODALITIES[
                item["modality"]].placeholder_texts(item, configs[item["modality"]]))
                for item, n in zip(media, counts)]
            encoded = inspector.text.encode(inspector.text.kinds.encodable(record), items)
        except TextError as exc:
            return _messages_view(record, f"no tokens: {exc.detail}; the messages as stored")
        except Exception as exc:     # a malformed record: show what is known, not a traceback
            return _messages_view(record, f"no tokens: {type(exc).__name__}: {exc}")
        ids, trained = encoded.ids, encoded.loss_mask.copy()
        if len(trained):
            trained[0] = False       # the first token is never a target
        note = (f"dropped ({stats.dropped}): shown as tokenized without the seq_length limit; "
                "none of it is trained")
    runs = _runs(inspector, ids, trained)
    if sample is not None and inspector.config.seq_length > stats.length:
        pad = inspector.config.seq_length - stats.length
        pad_token = inspector.text.tokenizer.convert_ids_to_tokens(inspector.text.pad_token_id)
        runs.append(TokenRun("padding", f"padding {pad_token}×{pad}", pad, collapsed=True))
    return TokenView(runs, note)


def _messages_view(record: Record, note: str) -> TokenView:
    """The stored messages (a caption's or document's text) as plain text, for a sample whose
    tokens cannot be built."""
    if record.get("kind") in ("caption", "document"):
        return TokenView([TokenRun("prompt", f"[{record['kind']}] {record.get('text')}", 0)],
                         note)
    try:
        # adjacent text parts on lines of their own (the template's joiner needs the template)
        text = "\n".join(f"[{m.get('role')}] " + str(m.get("content")).replace(
            TEXT_PART_BREAK, "\n") + "".join(
            f"\n  {key}: {json.dumps(m[key], ensure_ascii=False)}"
            for key in ("tools", "tool_calls") if m.get(key))
            for m in record.get("messages") or [])
    except (AttributeError, TypeError):
        text = repr(record.get("messages"))
    return TokenView([TokenRun("prompt", text, 0)], note)


def _runs(inspector: SampleInspector, ids: np.ndarray, trained: np.ndarray) -> list[TokenRun]:
    classes = np.where(trained, 1, 0)
    names = ["prompt", "trained"]
    for modality, token_id in inspector.token_ids.items():
        names.append(modality)
        classes[ids == token_id] = len(names) - 1
    if not len(ids):
        return []
    starts = np.flatnonzero(np.concatenate([[True], classes[1:] != classes[:-1]]))
    ends = np.append(starts[1:], len(ids))
    runs = []
    for start, end in zip(starts.tolist(), ends.tolist()):
        cls = names[classes[start]]
        if cls in inspector.token_ids:
            token = inspector.config.modalities[cls].token
            runs.append(TokenRun(cls, f"{token}×{end - start}", end - start, collapsed=True))
        else:
            text = inspector.text.backend.decode(ids[start:end].tolist(),
                                                 skip_special_tokens=False)
            runs.append(TokenRun(cls, text, end - start))
    return runs


def format_runs(view: TokenView, color: bool) -> str:
    """The token runs as terminal text: ANSI colours, or «» around trained text and [] around
    collapsed runs when colours are off."""
    parts = []
    for run in view.runs:
        text = f"[{run.text}]" if run.collapsed else run.text
        if color:
            parts.append(f"{ANSI[run.cls]}{text}{ANSI_RESET}")
        elif run.cls == "trained":
            parts.append(f"«{text}»")
        else:
            parts.append(text)
    return "".join(parts)


def _media_line(item: dict, tokens: int | None) -> str:
    size = size_text(item.get("bytes", 0))
    kind = MODALITIES.get(item.get("modality"))               # type: ignore[arg-type]
    what = kind.describe(item) if kind else "?"
    shown = "?" if tokens is None else tokens
    return (f"{item.get('member', '?'):10s} {item.get('modality', '?'):6s} "
            f"{item.get('format', '?'):5s} {what:24s} {size:>9s}  -> {shown} tokens")


def _frame_times_line(item: dict, config) -> str:
    """``frames at 0.00 0.50 ... s`` of an item with frames (the seconds of those the
    encoder gets, by its modality's sampling), then the texts the model reads before each run
    of its placeholders (Qwen3-VL's ``<0.3 seconds>`` per temporal patch) if it has them; ""
    otherwise."""
    kind = MODALITIES.get(item.get("modality"))               # type: ignore[arg-type]
    if kind is None or kind.name not in config.modalities:
        return ""
    try:
        times = kind.frame_times(item, config.modalities[kind.name])
        texts = kind.placeholder_texts(item, config.modalities[kind.name])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return f"frames: none sampled ({exc})"
    if times is None:
        return ""
    line = f"frames at {_abridged([f'{t:.2f}' for t in times])} s ({len(times)} sampled)"
    return line + (f", timestamps {_abridged(list(texts))}" if texts else "")


_SHOWN = 24     # the values of a frame-times line shown whole; a longer one is abridged


def _abridged(values: list[str]) -> str:
    """``values`` joined by spaces; past ``_SHOWN`` (a long clip's hundreds), its first 16,
    '...' and its last 4."""
    if len(values) <= _SHOWN:
        return " ".join(values)
    return " ".join([*values[:16], "...", *values[-4:]])


def sample_problems(stats: SampleStats) -> list[str]:
    """One line per thing that makes this sample fail a report check."""
    problems = []
    if stats.dropped:
        problems.append(f"dropped ({stats.dropped}): {stats.detail}")
    if stats.removed_turns:
        problems.append(f"truncated: {stats.removed_turns} trailing turn(s) removed to fit "
                        "seq_length")
    if stats.empty_answers:
        problems.append(f"empty answers: {stats.empty_answers} answer(s) without text train "
                        "their end of turn alone (the model learns to answer with nothing)")
    if stats.reasoning_dropped:
        problems.append(f"reasoning dropped: {stats.reasoning_dropped} answer(s) train without "
                        "their reasoning (the chat template leaves it out of these turns and "
                        "writes later ones', as at inference)")
    if stats.unclosed_think:
        problems.append(f"unclosed think: {stats.unclosed_think} answer(s) hold a <think> with "
                        "no </think> after it (trained as text: the model learns to open a "
                        "think block it never closes; close it or take it out)")
    if stats.trailing_turns:
        problems.append(f"trailing turns: {stats.trailing_turns} turn(s) after the last answer "
                        "(a user's, a tool's) train nothing: a final answer lost?")
    if stats.marker_mismatch:
        problems.append(f"marker/media mismatch: {stats.describe_markers()}")
    if stats.placeholder_mismatch:
        problems.append(f"placeholder mismatch: {stats.describe_placeholders()}")
    for problem in stats.index_problems:
        problems.append(f"index mismatch: {problem}")
    if stats.coverage_failure:
        problems.append("loss mask coverage: " + "; ".join(stats.coverage_problems))
    return problems


def _counts(tokens: list[int | None]) -> str:
    """Tokens per item for people: ``[64, ?]`` (``?``: what the metadata cannot say, as the
    media line writes it)."""
    return "[" + ", ".join("?" if n is None else str(n) for n in tokens) + "]"


def format_sample(inspector: SampleInspector, record: Record, stats: SampleStats,
                  sample: Sample | None, total: int, color: bool) -> str:
    """Header (status, placeholder counts, media), legend and coloured tokens of one sample."""
    config = inspector.config
    source = record.get("source") or {}
    where = " ".join(f"{k} {v}" for k, v in source.items())
    lines = [f"sample {stats.key}  (position {stats.position} of {total})  source {where}"
             + (f"  id {record['id']}" if record.get("id") else "")]
    if stats.dropped:
        lines.append(f"status      DROPPED ({stats.dropped}): {stats.detail}")
    else:
        fraction = stats.trained / stats.length if stats.length else 0.0
        lines.append(f"status      kept: {stats.length} tokens of seq_length {config.seq_length}"
                     f" ({config.seq_length - stats.length} padding), {stats.trained} trained "
                     f"({fraction:.1%}), {stats.removed_turns} turn(s) removed")
    media = record.get("media") or []
    for modality in config.modalities:
        items = [item for item in media if item.get("modality") == modality]
        if not items and not stats.placeholders.get(modality):
            continue
        expected = [expected_item_tokens(item, config) for item in items]
        if stats.dropped:
            lines.append(f"{modality:11s} expected {_counts(expected)} tokens per item from "
                         "metadata (no input_ids: the sample is dropped)")
            continue
        kept = stats.expected.get(modality, [])
        placeholders = stats.placeholders.get(modality, 0)
        verdict = ("OK" if None not in kept and placeholders == sum(k or 0 for k in kept)
                   else "MISMATCH")
        lines.append(f"{modality:11s} {placeholders} placeholder tokens in input_ids, expected "
                     f"{sum(n for n in kept if n is not None)} from metadata {_counts(kept)}"
                     + (f" ({len(items) - len(kept)} item(s) in removed turns)"
                        if len(items) > len(kept) else "") + f"  {verdict}")
    for i, item in enumerate(media):
        label = "media" if i == 0 else ""
        lines.append(f"{label:11s} {_media_line(item, expected_item_tokens(item, config))}")
        times = _frame_times_line(item, config)
        if times:
            lines.append(f"{'':11s} {times}")
    counts = {m: (stats.markers.count(m), stats.media.count(m))
              for m in sorted(set(stats.markers) | set(stats.media))}
    if counts:
        lines.append("markers     " + ", ".join(f"{m}: {a} in the text / {b} items"
                                                for m, (a, b) in counts.items())
                     + ("  OK" if not stats.marker_mismatch else "  MISMATCH (order or count)"))
    for problem in sample_problems(stats):
        lines.append(f"PROBLEM     {problem}")
    view = token_view(inspector, record, stats, sample)
    legend = []
    for cls in ("trained", "prompt", *config.modalities, "padding"):
        name = CLASS_NAMES.get(cls, cls)
        if color:
            legend.append(f"{ANSI[cls]}{name}{ANSI_RESET}")
        else:
            legend.append({"trained": "«trained»", "padding": "[padding]"}.get(
                cls, f"[{name}]" if cls in config.modalities else name))
    lines.append("legend      " + "  ".join(legend))
    if view.note:
        lines.append(f"note        {view.note}")
    lines.append("-" * 80)
    lines.append(format_runs(view, color))
    return "\n".join(lines)
