"""Whether a trained EOS token follows each answer: the ``append_eos`` preprocessing key.

A chat template usually ends an assistant turn with a token the model learns to generate and
decoding stops at (ChatML's ``<|im_end|>``, Llama 2's ``</s>``); the loss covers each answer
through it. Some templates write none: llava-hf's LLaVA-1.5 template follows an answer with a
space and the next ``USER:``, so no token after an answer would be trained and a fine-tuned
model would never learn to stop. LLaVA's own training (its ``v1`` conversation, whose
``sep2`` is ``</s>``) follows every answer with ``</s>`` and trains it. ``append_eos``:

- ``auto`` (the default): on when the template writes no end-of-turn token (below);
- ``true``: on whatever the template writes;
- ``false``: off.

On, every answer whose turn does not end with the tokenizer's EOS gets it appended as a token
right after the answer's last token, trained; the rendered text is not changed, so every other
token is the template's. Caption mode already ends each answer with the EOS. Off (and ``auto``
where the template ends its turns), an answer is trained through the token the template
writes after it (``turn_end``), which may be another than the tokenizer's EOS: ChatML's
``<|im_end|>`` beside a base checkpoint's ``<|endoftext|>``.

Detection: a conversation of two exchanges is rendered with placeholder contents. The template
ends its turns when what it writes after each answer, up to the next message's content or the
end of the text, holds the EOS or another special token of the tokenizer (not the BOS, the
padding or unknown token, nor a modality's token or marker).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

# A two-exchange conversation whose contents are private-use code points (found once each).
PROBE = [{"role": role, "content": content} for role, content in
         (("user", "\ue010"), ("assistant", "\ue011"), ("user", "\ue012"),
          ("assistant", "\ue013"))]


@dataclass(frozen=True)
class EosAppending:
    """What ``append_eos`` comes to for one tokenizer and template."""
    setting: str | bool       # the config's value: auto, true or false
    on: bool                  # each answer not ending with the EOS gets it appended
    token: str                # the EOS token
    reason: str               # why, for mimo-inspect report

    def to_dict(self) -> dict:
        return {"setting": self.setting, "on": self.on, "token": self.token,
                "reason": self.reason}


def answer_endings(render: Callable[[list[dict]], str]) -> list[str] | None:
    """What the template writes after each answer of ``PROBE`` (up to the next content or the
    end of the text); None when it fails on the probe or does not write each content once."""
    try:
        text = render(PROBE)
    except Exception:   # the template's own raise_exception(), jinja errors
        return None
    contents = [message["content"] for message in PROBE]
    if any(text.count(content) != 1 for content in contents):
        return None
    at = [text.index(content) for content in contents]
    if at != sorted(at):
        return None
    bounds = [*at[1:], len(text)]
    return [text[at[k] + 1:bounds[k]] for k, message in enumerate(PROBE)
            if message["role"] == "assistant"]


def eos_appending(setting: str | bool, eos: str, endings: list[str] | None,
                  end_tokens: Collection[str]) -> EosAppending:
    """``setting`` resolved for a chat template whose answers are followed by ``endings``
    (``answer_endings``), ``end_tokens`` the tokenizer's tokens that can end a turn."""
    if setting is True:
        return EosAppending(setting, True, eos, "append_eos: true")
    if setting is False:
        return EosAppending(setting, False, eos, "append_eos: false")
    if endings is None:
        return EosAppending(setting, False, eos, "auto: the chat template's turn endings "
                            "cannot be read from a probe conversation; set append_eos: true "
                            "if it writes no end-of-turn token")
    end = turn_end(endings, end_tokens)
    if end is not None:
        return EosAppending(setting, False, eos, f"auto: the chat template ends each answer "
                            f"with {end!r}")
    return EosAppending(setting, True, eos, "auto: the chat template writes no end-of-turn "
                        "token after an answer")


def turn_end(endings: list[str] | None, end_tokens: Collection[str]) -> str | None:
    """The token the template writes first after every answer (``answer_endings``), one of
    ``end_tokens``: ChatML's ``<|im_end|>``, also where the tokenizer's EOS is another (a base
    checkpoint's ``<|endoftext|>``); None where some answer is followed by none."""
    if endings is None:
        return None
    ends = []
    for ending in endings:
        found = [(ending.index(token), token) for token in end_tokens if token in ending]
        if not found:
            return None
        ends.append(min(found)[1])
    return ends[0]


def end_tokens(tokenizer, excluded: Collection[str]) -> list[str]:
    """The tokenizer's special tokens that can end a turn: the EOS first, then the other
    special added tokens but the BOS, padding, unknown and ``excluded`` ones."""
    others = {tokenizer.bos_token, tokenizer.pad_token, tokenizer.unk_token, *excluded}
    special = [token.content for token in tokenizer.added_tokens_decoder.values()
               if token.special and token.content not in others]
    return [tokenizer.eos_token, *(t for t in special if t != tokenizer.eos_token)]


def caption_appending(setting: str | bool, eos: str) -> EosAppending:
    """Caption mode: the EOS is in the text after every answer already."""
    return EosAppending(setting, False, eos, "caption mode writes the EOS after each answer")
