"""Where a training config's values come from: the YAML file and ``key.path=value`` overrides
(values parsed as YAML), paths made absolute (a YAML's from its folder, an override's from the
working directory; hub names kept), before the values are read by their types (``fields``).
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from mimo_data.files import load_yaml
from mimo_data.hub import shadowed
from mimo_data.shards.storage import is_remote, mistyped_url
from mimo_train.errors import TrainConfigError

# (section, ..., key): path values; "*" matches any key; a list value is a list of paths.
PATH_KEYS = (("data", "datasets"), ("data", "preprocess"), ("data", "valid"), ("data", "cache_dir"),
             ("model", "init_from"), ("model", "pretrained"),
             ("model", "encoders", "*", "pretrained"), ("model", "language", "pretrained"),
             ("train", "tensorboard_dir"), ("train", "wandb", "dir"), ("train", "profile", "dir"),
             ("checkpoint", "dir"))
_HUB_KEYS = {("model", "pretrained"), ("model", "encoders", "*", "pretrained"),
             ("model", "language", "pretrained")}
# the path keys that take a URL as well (read through fsspec); the others are files and folders
# of this machine's (or a shared) filesystem
_URL_KEYS = {("data", "datasets"), ("data", "valid"), ("train", "tensorboard_dir")}
_WHY_LOCAL = {("checkpoint", "dir"): "every rank writes its part of a checkpoint into it: give "
                                     "a shared filesystem's folder (and copy checkpoints to the "
                                     "bucket after, if wanted)",
              ("data", "cache_dir"): "the derived tables are memory-mapped from it: give a "
                                     "local disk's folder"}


def _resolve(value: str, base: str, hub: bool, key: str, pattern: tuple) -> str:
    if value.startswith("file:"):                     # file:///x, file:/x: the path /x
        value = "/" + value[len("file:"):].lstrip("/")
    meant = mistyped_url(value)
    if meant is not None:
        raise TrainConfigError(f"{key}: {value} is a URL with one slash after its scheme? "
                               f"write {meant}")
    if is_remote(value):                              # a URL: s3://bucket/prefix ...
        if pattern not in _URL_KEYS:
            raise TrainConfigError(
                f"{key}: {value} is a URL, and {key} is a path of this machine's filesystem: "
                + _WHY_LOCAL.get(pattern, "copy it here first (e.g. `aws s3 sync URL DIR`, "
                                 "`gcloud storage cp -r URL DIR`) and give DIR"))
        return value
    expanded = os.path.expanduser(value)
    path = os.path.normpath(os.path.join(base, expanded))
    if hub and not (os.path.isabs(expanded) or value.startswith((".", "~"))
                    or os.path.exists(path)):
        found = shadowed(value, key, path)
        if found is not None:
            raise TrainConfigError(found)
        return value                                  # a hub name, e.g. org/model
    return path


def resolve_paths(data: dict, base: str) -> None:
    """Make the path values in a raw config mapping absolute, relative ones taken from
    ``base``; values of the wrong type are left for the type checks."""
    def walk(node, keys: tuple, pattern: tuple, above: tuple):
        if not isinstance(node, dict):
            return
        head, rest = keys[0], keys[1:]
        names = list(node) if head == "*" else [head] if head in node else []
        for name in names:
            if rest:
                walk(node[name], rest, pattern, (*above, name))
                continue
            value, hub, key = node[name], pattern in _HUB_KEYS, ".".join((*above, str(name)))
            if isinstance(value, str) and value:
                node[name] = _resolve(value, base, hub, key, pattern)
            elif isinstance(value, list):
                node[name] = [_resolve(v, base, hub, key, pattern) if isinstance(v, str) and v
                              else v for v in value]

    for pattern in PATH_KEYS:
        walk(data, pattern, pattern, ())


def _lora_part_joined(parts: list[str], lora_settings: frozenset[str], value: Any
                      ) -> list[str]:
    """An override's keys with a dotted LoRA part kept whole: ``model.lora.image.encoder.rank``
    sets ``rank`` of the part ``image.encoder``, ``model.lora.image.encoder={...}`` the part
    (a mapping or empty ``value`` under a last key that is none of ``lora_settings``); otherwise the
    last key is the part's setting (a typo named as such by the type checks)."""
    if parts[:2] != ["model", "lora"] or len(parts) <= 3:
        return parts
    if (value is None or isinstance(value, dict)) and parts[-1] not in lora_settings:
        return ["model", "lora", ".".join(parts[2:])]
    return ["model", "lora", ".".join(parts[2:-1]), parts[-1]]


def _remove(data: dict, override: str, lora_settings: frozenset[str]) -> None:
    """``~key.path`` (Hydra's form): remove the key from the raw mapping, a YAML's entry of a
    mapping (``~model.lora.image``) included, where ``key.path=null`` sets it to null (an
    entry of its defaults)."""
    key = override[1:]
    if not key or "=" in key:
        raise TrainConfigError(f"override {override!r}: ~key.path removes a key and takes no "
                               "value (e.g. ~model.lora.image)")
    node: Any = data
    parts = _lora_part_joined(key.split("."), lora_settings, None)
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or parts[-1] not in node:
        raise TrainConfigError(f"override {override!r}: the config sets no {key}, so there is "
                               "nothing to remove")
    del node[parts[-1]]


def _comment_in(text: str) -> bool:
    """Whether YAML reads part of ``text`` as a comment (what follows its last token)."""
    if "#" not in text:
        return False
    tokens = [token for token in yaml.scan(text)
              if not isinstance(token, (yaml.StreamStartToken, yaml.StreamEndToken))]
    return bool(text[tokens[-1].end_mark.index if tokens else 0:].strip())


def apply_override(data: dict, override: str, base: str,
                   lora_settings: frozenset[str] = frozenset()) -> None:
    """Set ``key.path=value`` in the raw mapping; path values are taken from ``base``;
    ``lora_settings``: the names of a LoRA part's settings (``_lora_part_joined``)."""
    if override.startswith("~"):
        _remove(data, override, lora_settings)
        return
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise TrainConfigError(f"override {override!r} is not key.path=value "
                               "(e.g. train.steps=50), or ~key.path to remove a key")
    try:
        value = load_yaml(text) if text else None
        if _comment_in(text):       # a path with " #" in it would be cut there without a word
            raise TrainConfigError(
                f"override {override!r}: YAML reads the value from its '#' on as a comment "
                f"(leaving {value!r}); quote the value: '{key}=\"{text}\"'")
    except yaml.constructor.ConstructorError as error:      # a key twice: said as it is
        raise TrainConfigError(f"override {override!r}: {error.problem}") from None
    except yaml.YAMLError as error:
        raise TrainConfigError(f"override {override!r}: the value is not valid YAML "
                               f"({error.__class__.__name__}); quote it or fix the brackets"
                               ) from None
    node = data
    parts = _lora_part_joined(key.split("."), lora_settings, value)
    for part in parts[:-1]:
        if node.get(part) is None:                    # absent, or an empty YAML section
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise TrainConfigError(f"override {override!r}: {part} is not a section")
        node = child
    alone: Any = value                                # the override as a mapping of its own
    for part in reversed(parts):
        alone = {part: alone}
    resolve_paths(alone, base)
    for part in parts:
        alone = alone[part]
    node[parts[-1]] = alone


