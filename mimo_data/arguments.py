"""What every command line (mimo-shard, mimo-inspect, mimo-train, mimo-export,
mimo-generate) reads its arguments with alike: kept free of heavy imports, as the commands'
``--help`` is."""

from __future__ import annotations

import os


def user_path(value: str) -> str:
    """A path given on a command line, its leading ``~`` expanded: the shell leaves
    ``--output=~/x`` and a quoted ``'~/x'`` as written (argparse's ``type`` of every path
    option; a URL or hub name is unchanged)."""
    return os.path.expanduser(value)
