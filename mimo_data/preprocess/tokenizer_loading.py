"""The configured tokenizer and its chat template, as the preprocessing loads them, and the
private tokenizer ``TextEncoder`` adds its markers to."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from typing import Any

from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer

from mimo_data.errors import ConfigError, listed
from mimo_data.hub import not_cached
from mimo_data.preprocess.config import PreprocessConfig, looks_like_path, wrong_path


def load_tokenizer(config: PreprocessConfig, *, shared: bool = True):
    """The configured tokenizer with each modality's special token added if missing.

    ``shared``: the one this process keeps for that folder's files and those tokens (see
    ``shared_tokenizer``), which no caller may change; False: a new one, for a caller that
    changes it."""
    name = config.tokenizer
    if looks_like_path(name) and not os.path.isdir(os.path.expanduser(name)):
        # Not a hub name either: say so instead of the hub's "Repo id must be in the form".
        raise ConfigError(wrong_path(f"tokenizer: {name!r}", name,
                                     os.path.abspath(os.path.expanduser(name)), "directory",
                                     " (in a YAML, paths are relative to its folder)"))
    if why := not_cached(name):
        raise ConfigError(f"tokenizer: {why}")
    key = _folder_key(name) if shared else None
    tokenizer = _kept(key, name)
    # one lookup per token (get_vocab makes a dict of the whole vocabulary: 0.1-0.3 s)
    missing = tuple(m.token for m in config.modalities.values()
                    if tokenizer.backend_tokenizer.token_to_id(m.token) is None)
    if missing and key is None:             # a tokenizer of this call's own
        return _added(tokenizer, missing)
    if missing:         # another tokenizer: the one kept stays as its files say
        tokenizer = _kept(key, name, missing)
    return tokenizer


def shared_tokenizer(name: str):
    """``AutoTokenizer.from_pretrained(name)``, the same object for every caller in this
    process (and the processes forked after it) that loads the same files: a local folder's,
    known by its files' contents (a hub name is loaded each time). No caller may change it."""
    return _kept(_folder_key(name), name)


# Loading a tokenizer takes 0.2-0.7 s for a 150-250k vocabulary (transformers parses
# tokenizer.json in Python for a class of its own, Qwen2Tokenizer's), and a process loads the
# same one several times (the trainer, its loader, the checks; an export, a generation), as
# does every DataLoader worker and rank forked after it. A process keeps the last few it
# loaded, by the contents of their files: a changed file is a new load (functools' caches key
# on the arguments, a folder's name, not on what its files hold).
_KEPT = 24
_LOADED: OrderedDict[tuple, Any] = OrderedDict()
_LOCK = threading.Lock()
# what AutoTokenizer never reads (a checkpoint's weights): not in a folder's key
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt",
            ".onnx", ".npz")


def _kept(key: tuple | None, name: str, added: tuple[str, ...] = ()) -> Any:
    """The tokenizer of ``name`` (with the tokens ``added``) kept under ``key``, its folder's,
    else loaded and kept (None: not kept; nor is one whose files changed while it loaded)."""
    if key is None:
        return _added(_loaded(name), added)
    with _LOCK:
        if (*key, added) in _LOADED:
            _LOADED.move_to_end((*key, added))
            return _LOADED[(*key, added)]
    tokenizer = _added(_loaded(name), added)
    if _folder_key(name) == key:
        with _LOCK:
            _LOADED[(*key, added)] = tokenizer
            while len(_LOADED) > _KEPT:
                _LOADED.popitem(last=False)
    return tokenizer


def _added(tokenizer, tokens: tuple[str, ...]):
    if tokens:
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in tokens],
                             special_tokens=True)
    return tokenizer


def _folder_key(name: str) -> tuple | None:
    """A local folder's path and the digest of the files AutoTokenizer may read there (its
    own, the weights left out, and its additional_chat_templates/; one over 64 MiB, which no
    tokenizer has, by its size, time and inode; one it cannot read, by the error), else
    None."""
    folder = os.path.realpath(os.path.expanduser(name))
    if not os.path.isdir(folder):
        return None
    digest = hashlib.blake2b()
    for path in _tokenizer_files(folder):
        digest.update(os.path.relpath(path, folder).encode() + b"\0")
        try:
            stat = os.stat(path)
            if stat.st_size > 64 << 20:
                digest.update(f"{stat.st_size} {stat.st_mtime_ns} {stat.st_ino}".encode())
                continue
            with open(path, "rb") as handle:
                digest.update(hashlib.file_digest(handle, "blake2b").digest())
        except OSError as error:
            digest.update(f"{type(error).__name__} {error.errno}".encode())
    return folder, digest.hexdigest()


def _tokenizer_files(folder: str) -> list[str]:
    files = []
    for sub in ("", "additional_chat_templates"):
        try:
            entries = sorted(os.scandir(os.path.join(folder, sub)), key=lambda e: e.name)
        except OSError:                                 # none there
            continue
        files += [entry.path for entry in entries
                  if entry.is_file() and not entry.name.endswith(_WEIGHTS)]
    return files


def _holds_tokenizer(folder: str) -> bool:
    """Whether ``folder`` holds a file of a tokenizer's (its tokenizer.json or config, a
    vocabulary, merges or a sentencepiece model)."""
    try:
        names = [entry.name for entry in os.scandir(folder) if entry.is_file()]
    except OSError:
        return True                     # transformers says why it cannot read it
    return any(name.startswith(("tokenizer", "vocab", "merges", "spiece", "tekken"))
               or name.endswith((".model", ".tiktoken")) for name in names)


def _folders_below(folder: str, depth: int = 2) -> list[str]:
    """The folders below ``folder``, ``depth`` levels down at most (a hub cache's model
    folder holds its files in snapshots/REVISION)."""
    try:
        found = sorted(entry.path for entry in os.scandir(folder) if entry.is_dir())
    except OSError:
        return []
    return found + [below for each in found for below in _folders_below(each, depth - 1)] \
        if depth > 1 else found


def _loaded(name: str):
    if os.path.isdir(name) and not _holds_tokenizer(name):
        # transformers' message for this speaks of sentencepiece and slow tokenizers
        inside = [below for below in _folders_below(name) if _holds_tokenizer(below)]
        raise ConfigError(f"tokenizer: {name} holds no tokenizer files (tokenizer.json, "
                          "tokenizer_config.json, a vocabulary): give the folder a model or "
                          "tokenizer was saved to" + (f" (here: {', '.join(inside)})"
                                                      if inside else ""))
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # hub errors, missing files, bad configs all surface here
        raise ConfigError(f"tokenizer: cannot load {name!r}: {exc} (give a local tokenizer "
                          "directory, or a hub name in the local hub cache)") from None


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
    named = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {}
    if override and "{" not in override and override not in named:
        raise ConfigError(f"chat_template is {override!r}, neither Jinja (no {{ in it), a "
                          "template file, nor a template the tokenizer names" + (
                              f" ({listed(named)})" if named else "") + ": mimo takes the "
                          "template itself, or the name of one of the tokenizer's, not another "
                          "tool's template name (LLaMA-Factory's template: qwen2_vl); leave "
                          "chat_template out to use the tokenizer's own")
    try:
        return tokenizer.get_chat_template(override)
    except ValueError as exc:
        kept = processor_chat_template(config.tokenizer)
        if kept is not None:
            return kept
        raise ValueError(f"tokenizer {config.tokenizer!r} has no chat template and none is "
                         f"configured (chat_template:), or use mode: caption ({exc})") from None


def processor_chat_template(name: str) -> str | None:
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

