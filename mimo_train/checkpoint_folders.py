"""A checkpoint.dir's folders and files by name: its steps' folders, ``latest`` naming the
last complete one, a step's ``meta.json``. No torch: the start-up's config checks read them
before anything is built (``components.checkpoint`` writes and loads the checkpoints)."""

from __future__ import annotations

import os

LATEST = "latest"
META = "meta.json"
STEP_NAME = r"step_\d{7}"          # a step's checkpoint folder in a checkpoint.dir


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:07d}")


def latest(root: str | None) -> str | None:
    """The checkpoint directory ``root/latest`` names, or None."""
    if not root:
        return None
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return os.path.join(root, name)


def step_of(path: str) -> str:
    """The step's checkpoint ``path`` names: a checkpoint.dir's latest (``latest``), as
    mimo-export takes it, else ``path`` itself."""
    return latest(path) or path
