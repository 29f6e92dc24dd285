"""Hub names are read from the local hub cache only (``HF_HUB_OFFLINE=1`` unless set).

By default mimo downloads no model or tokenizer at run time: every rank of a job would fetch
it at once, and a node without network would wait on transformers' retries for each file (27 s
for an uncached name, nearly three minutes for a cached Qwen2-VL's preprocessing config) before
reading the cache it had all along. Each command calls ``cache_only`` before it reads one."""

from __future__ import annotations

import os
import sys
from typing import Any

OFFLINE = "HF_HUB_OFFLINE"


def cache_only() -> None:
    """Hub reads from the local cache, no request made, unless the user set ``HF_HUB_OFFLINE``
    (or ``TRANSFORMERS_OFFLINE``) themselves."""
    if OFFLINE in os.environ or "TRANSFORMERS_OFFLINE" in os.environ:
        return
    os.environ[OFFLINE] = "1"
    constants: Any = sys.modules.get("huggingface_hub.constants")
    if constants is not None:            # imported already (read at import): set it there too
        constants.HF_HUB_OFFLINE = True


def not_cached(name: str) -> str | None:
    """Why the hub name ``name`` cannot be read (offline, and not in the local hub cache: what
    to do), or None where it is a local directory, the cache holds it or downloads are
    allowed."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    if os.path.isdir(os.path.expanduser(name)) or not constants.is_offline_mode():
        return None
    try:
        snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        return (f"the hub name {name!r} is not in the local hub cache ({constants.HF_HUB_CACHE})"
                f": mimo reads the cache only. Download it first (hf download {name}) with "
                "HF_HUB_CACHE or HF_HOME naming the cache this machine reads, or give its "
                f"directory (no folder {os.path.abspath(os.path.expanduser(name))} exists, "
                "if a path was meant)")
    return None


def shadowed(name: str, key: str, beside: str) -> str | None:
    """Why ``name``, the value of a YAML's ``key`` kept as a hub name because ``beside`` (its
    path from the YAML's folder) does not exist, cannot be: the working directory holds a
    folder of that name, which transformers would read instead of the hub cache, so the model
    would depend on where the command runs (and a run's saved ``name`` would not be found from
    elsewhere). None where the working directory has no such folder."""
    folder = os.path.abspath(os.path.expanduser(name))
    if not os.path.isdir(folder):
        return None
    return (f"{key}: {name} is not beside the YAML ({beside}), so it would be a hub name, but "
            f"the working directory has a folder of that name ({folder}), which transformers "
            "would read instead: paths in a YAML are taken from the YAML's folder. Write the "
            f"folder's absolute path ({folder}) or its path from the YAML's folder")
