"""The configured tokenizer and its chat template, as the preprocessing loads them, and the
private tokenizer ``TextEncoder`` adds its markers to."""

from __future__ import annotations

import os

from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer

from mimo_data.errors import ConfigError
from mimo_data.hub import not_cached
from mimo_data.preprocess.config import PreprocessConfig, looks_like_path


def load_tokenizer(config: PreprocessConfig):
    """The configured tokenizer with each modality's special token added if missing."""
    name = config.tokenizer
    if looks_like_path(name) and not os.path.isdir(os.path.expanduser(name)):
        # Not a hub name either: say so instead of the hub's "Repo id must be in the form".
        raise ConfigError(f"tokenizer: {name!r} is {os.path.abspath(os.path.expanduser(name))}, "
                          "which is not a directory (in a YAML, paths are relative to its "
                          "folder)")
    if why := not_cached(name):
        raise ConfigError(f"tokenizer: {why}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # hub errors, missing files, bad configs all surface here
        raise ConfigError(f"tokenizer: cannot load {name!r}: {exc} (give a local tokenizer "
                          "directory, or a hub name in the local hub cache)") from None
    # one lookup per token (get_vocab makes a dict of the whole vocabulary: 0.1-0.3 s)
    missing = [m.token for m in config.modalities.values()
               if tokenizer.backend_tokenizer.token_to_id(m.token) is None]
    if missing:
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing],
                             special_tokens=True)
    return tokenizer


def tokenizer_of_its_own(backend: Tokenizer) -> Tokenizer:
    """A tokenizer encoding as ``backend`` does (without padding or truncation, its special
    tokens matched as tokens: transformers' ``split_special_tokens`` sets ``backend``'s
    ``encode_special_tokens``, which would split the template's and the markers') whose added
    tokens are its own: a new pipeline around the same model (the vocabulary and merges,
    shared and never changed) with ``backend``'s normalizer, pre-tokenizer, post-processor,
    decoder and added tokens. (A copy through ``to_str`` and ``from_str`` writes and parses
    the whole vocabulary: 0.3-0.7 s for 150-250k tokens, at every rank's start-up.)"""
    own = Tokenizer(backend.model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        if getattr(backend, part) is not None:
            setattr(own, part, getattr(backend, part))
    added = backend.get_added_tokens_decoder()
    # tokenizers gives an added token its id in the model's vocabulary, else the one after
    # the added ids so far: given again in id order, each gets its id back
    own.add_tokens([added[token_id] for token_id in sorted(added)])
    assert _added_tokens(own) == _added_tokens(backend), "added tokens given other ids"
    return own


def _added_tokens(tokenizer: Tokenizer) -> dict[int, tuple]:
    return {token_id: (t.content, t.single_word, t.lstrip, t.rstrip, t.normalized, t.special)
            for token_id, t in tokenizer.get_added_tokens_decoder().items()}


def chat_template(config: PreprocessConfig, tokenizer) -> str:
    """The configured ``chat_template`` (inline or a file), else the tokenizer's, else the one
    its processor keeps (ValueError naming the tokenizer if none)."""
    override = config.chat_template
    if override and os.path.isfile(override):
        with open(override) as handle:
            override = handle.read()
    try:
        return tokenizer.get_chat_template(override)
    except ValueError as exc:
        kept = _processor_chat_template(config.tokenizer)
        if kept is not None:
            return kept
        raise ValueError(f"tokenizer {config.tokenizer!r} has no chat template and none is "
                         f"configured (chat_template:), or use mode: caption ({exc})") from None


def _processor_chat_template(name: str) -> str | None:
    """The chat template a processor keeps beside the tokenizer (``chat_template.jinja``, or
    ``chat_template.json``'s ``chat_template``), where the tokenizer has none: llava-hf
    repositories keep theirs there only. A local directory, or a hub name's cached files."""
    import json

    from huggingface_hub import try_to_load_from_cache
    directory = os.path.expanduser(name)
    for file in ("chat_template.jinja", "chat_template.json"):
        path = (os.path.join(directory, file) if os.path.isdir(directory)
                else try_to_load_from_cache(name, file))
        if isinstance(path, str) and os.path.isfile(path):
            with open(path) as handle:
                text = handle.read()
            return text if file.endswith(".jinja") else json.loads(text)["chat_template"]
    return None


def added_bos(tokenizer) -> str:
    """The BOS token's text if the tokenizer puts it before every text it encodes, else ""."""
    if tokenizer.bos_token is None:
        return ""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    added = tokenizer("a", add_special_tokens=True)["input_ids"]
    return tokenizer.bos_token if added == [tokenizer.bos_token_id, *plain] else ""

