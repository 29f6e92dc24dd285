"""Errors shared by every subpackage: a config value that cannot work."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and what to change."""
