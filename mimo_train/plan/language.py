"""The run's language model: its dims and M-RoPE section from its checkpoint (any also set in
``model.language`` must agree) or from the config and ``LANGUAGE_DEFAULTS``, its memory
settings, and the rows of its embedding and output layer (``Vocabulary``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from mimo_train.config import LANGUAGE_DEFAULTS, LanguageConfig, check_mrope
from mimo_train.errors import TrainConfigError
from mimo_train.families.causal_lm import LanguageArch
from mimo_train.families.registry import language_arch


class Vocabulary(NamedTuple):
    """The language model's embedding and output rows (before ``vocab_rows``' TP padding),
    and the entries it predicts: rows past ``predicted`` never enter a softmax (None: a model
    trained from scratch, all its rows its own)."""
    rows: int
    predicted: int | None


@dataclass(frozen=True)
class LanguagePlan:
    """The language model a run builds (``model.language`` resolved)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None            # None: 4 x hidden_size (a random init's MLP)
    mrope_section: tuple[int, ...] | None
    pretrained: str | None
    arch: LanguageArch | None              # the checkpoint's (dims from config.json)
    vocab_size: int | None                 # model.language.vocab_size
    vocab_multiple: int
    recompute: str
    sequence_parallel: bool
    moe_aux_loss: float = 0.0              # the balancing loss's coefficient (0: off)
    loss_chunk_tokens: int = 0             # the loss taken this many tokens at a time (0: all)

    @property
    def num_query_groups(self) -> int:
        return self.arch.num_query_groups if self.arch else self.num_attention_heads

    @property
    def experts(self) -> int:
        return self.arch.experts if self.arch else 0

    def vocabulary(self, tokenizer_size: int) -> Vocabulary:
        """The rows for a tokenizer of ``tokenizer_size`` tokens (modality tokens included):
        ``model.language.vocab_size``, else the tokenizer's vocabulary (a pretrained
        checkpoint's, when larger) padded to ``vocab_multiple`` as megatron-core pads it. The
        same rows under every layout, so a checkpoint loads under any TP size."""
        predicted = max(tokenizer_size, self.arch.vocab_size) if self.arch else None
        needed = predicted or tokenizer_size
        if self.vocab_size is None:
            return Vocabulary(-(-needed // self.vocab_multiple) * self.vocab_multiple, predicted)
        if self.vocab_size < tokenizer_size:
            raise TrainConfigError(
                f"model.language.vocab_size {self.vocab_size} is smaller than the tokenizer's "
                f"{tokenizer_size} tokens (modality tokens included): token ids would index "
                f"past the embedding; set it >= {tokenizer_size} or leave it unset")
        if self.vocab_size < needed:
            raise TrainConfigError(
                f"model.language.vocab_size {self.vocab_size} is smaller than the vocabulary "
                f"of model.language.pretrained ({needed}): set it >= {needed} or leave it unset")
        return Vocabulary(self.vocab_size, predicted)


def vocab_rows(rows: int, tp: int) -> int:
    """The embedding and output rows split over ``tp`` ranks: ``rows`` padded up to a multiple
    of ``tp`` (megatron-core splits them evenly; a TP size dividing ``vocab_multiple`` adds
    none)."""
    return -(-rows // tp) * tp


def language_plan(language: LanguageConfig, pretrained: str | None,
                  source: str = "model.language.pretrained") -> LanguagePlan:
    """``model.language`` resolved; ``pretrained``: its checkpoint (a whole VLM's or its own;
    read from ``config.json`` alone, no weights), which the config key ``source`` gives."""
    arch = language_arch(pretrained, source, weights=False) if pretrained else None
    dims = {name: getattr(language, name) for name in (*LANGUAGE_DEFAULTS, "ffn_hidden_size")}
    section = language.mrope_section
    if arch is None:
        dims.update({name: default for name, default in LANGUAGE_DEFAULTS.items()
                     if dims[name] is None})
        hidden, heads = dims["hidden_size"], dims["num_attention_heads"]
        if hidden % heads:          # each head takes hidden / heads channels of the width
            near = [n for n in range(max(1, heads // 2), 2 * heads + 1) if hidden % n == 0]
            raise TrainConfigError(
                f"model.language.num_attention_heads {heads} does not divide "
                f"model.language.hidden_size {hidden}: each head takes hidden_size / heads "
                f"channels; give heads that divide it (e.g. {', '.join(map(str, near or [1]))})")
        head_dim = hidden // heads
        if head_dim % 2:            # the rotary turns each head's channels in pairs
            near = [n for n in range(1, 2 * heads + 1) if hidden % n == 0
                    and hidden // n % 2 == 0][-4:]
            raise TrainConfigError(
                f"model.language: num_attention_heads {heads} over hidden_size {hidden} makes "
                f"heads of {head_dim} channels, an odd number, and the rotary positions turn a "
                "head's channels in pairs: give heads that make it even"
                + (f" (e.g. {', '.join(map(str, near))})" if near else
                   ", or an even hidden_size"))
    else:
        for name, given in dims.items():
            actual = getattr(arch, name)
            if given is not None and given != actual:
                raise TrainConfigError(
                    f"model.language.{name} is {given}, but {source} {pretrained} has "
                    f"{name} {actual}: drop the key or make them agree")
            dims[name] = actual
        if arch.mrope_section is not None:
            if section is not None and list(section) != list(arch.mrope_section):
                raise TrainConfigError(
                    f"model.language.mrope_section is {section}, but {source} {pretrained} "
                    f"has {list(arch.mrope_section)}: drop the key or make them agree")
            section = list(arch.mrope_section)
        head_dim = round(arch.kv_channels * arch.rotary_percent)     # the part that rotates
    check_mrope(section, head_dim)
    return LanguagePlan(
        dims["num_layers"], dims["hidden_size"], dims["num_attention_heads"],
        dims["ffn_hidden_size"], tuple(section) if section is not None else None, pretrained,
        arch, language.vocab_size, language.vocab_multiple, language.recompute,
        language.sequence_parallel, language.moe_aux_loss, language.loss_chunk_tokens)
