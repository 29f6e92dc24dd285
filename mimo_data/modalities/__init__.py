"""The modalities mimo knows, by name: one module each behind ``base.Modality``.

Adding one is a new module implementing ``Modality`` plus its line here.
"""

from __future__ import annotations

from mimo_data.errors import ConfigError, listed
from mimo_data.modalities.audio import AUDIO
from mimo_data.modalities.base import MediaError, MediaItem, Modality
from mimo_data.modalities.image import IMAGE
from mimo_data.modalities.video import VIDEO

MODALITIES: dict[str, Modality] = {m.name: m for m in (IMAGE, AUDIO, VIDEO)}
MARKERS: dict[str, str] = {name: m.marker for name, m in MODALITIES.items()}


def modality(name: str) -> Modality:
    """The registered modality ``name`` (ConfigError naming the known ones otherwise)."""
    try:
        return MODALITIES[name]
    except KeyError:
        raise ConfigError(f"modality {name!r} unknown: use one of {listed(sorted(MODALITIES))}") \
            from None


__all__ = ["MARKERS", "MODALITIES", "MediaError", "MediaItem", "Modality", "modality"]
