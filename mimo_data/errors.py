"""Errors shared by every subpackage: a config value that cannot work, the hint that names
the key a misspelt one most likely meant, and names listed in a message as people write them."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and what to change."""


class UnreadableConfig(ConfigError):
    """A config file that cannot be read (gone, no permission): to restore, not to edit."""


def meant(unknown: Iterable[str], known: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean X?)`` for the unknown keys of one section close to a known one of it
    (difflib's ratio 0.75 and more on the bare names: ``seq_lenght``: ``seq_length``; several:
    ``A -> X, B -> Y``), each named with ``prefix`` (``train.``), else ""."""
    unknown, known = list(unknown), list(known)
    guesses = [(prefix + name, prefix + close[0]) for name in unknown
               if (close := difflib.get_close_matches(name, known, n=1, cutoff=0.75))]
    if len(unknown) == 1 and guesses:
        return f" (did you mean {guesses[0][1]}?)"
    said = ", ".join(f"{name} -> {close}" for name, close in guesses)
    return f" (did you mean {said}?)" if guesses else ""


def listed(items: Iterable) -> str:
    """``items`` in a message as words, not Python's repr: ``a, b, c`` (``none`` for none)."""
    return ", ".join(str(item) for item in items) or "none"
