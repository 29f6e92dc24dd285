"""Print the digest of what ``requirements.lock`` is resolved from: pyproject.toml's
``requires-python``, dependencies, optional dependencies and build requirements.

``tools/lock.sh`` (``make lock``) writes it into the lock; ``tools/setup.sh`` refuses a lock
whose digest is not pyproject.toml's, so a dependency added or changed without ``make lock``
stops the set-up with that advice instead of resolving something unpinned. Tool settings
(ruff, mypy, pytest) are left out: changing them needs no new lock.

    python tools/lock_inputs.py [pyproject.toml]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tomllib
from pathlib import Path


def lock_inputs(pyproject: Path) -> dict[str, object]:
    """The parts of ``pyproject`` that the lock's resolution depends on."""
    data = tomllib.loads(pyproject.read_text())
    project = data.get("project", {})
    return {"requires-python": project.get("requires-python"),
            "dependencies": project.get("dependencies", []),
            "optional-dependencies": project.get("optional-dependencies", {}),
            "build-system.requires": data.get("build-system", {}).get("requires", [])}


def digest(pyproject: Path) -> str:
    """sha256 of ``lock_inputs(pyproject)`` (keys sorted, so only their content counts)."""
    text = json.dumps(lock_inputs(pyproject), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("pyproject", nargs="?", default="pyproject.toml", type=Path)
    print(digest(parser.parse_args(argv).pyproject))


if __name__ == "__main__":
    main()
