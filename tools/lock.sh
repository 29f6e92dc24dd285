#!/usr/bin/env bash
# Resolve pyproject.toml's dependencies with the dev extras once, into requirements.lock: every
# package `pip install -e '.[dev]'` needs, pinned with == and its sha256 hashes. tools/setup.sh
# installs exactly that (make demo, make test and CI alike), so a new release on PyPI changes
# nothing until this is run again and the lock's diff committed.
#
#   make lock                                             # follow pyproject.toml, keep other pins
#   make lock LOCK_ARGS=--upgrade                         # every package to its newest allowed
#   make lock LOCK_ARGS="--upgrade-package transformers"  # one package
#
# The resolver is uv's `uv pip compile` (pinned below, installed into build/lock-tool): it
# resolves for a target (CPython 3.12 on x86-64 Linux, glibc >= 2.28) without installing
# anything, writes pip's requirements format with hashes, prefers the pins already in the
# lock, and reads no pip configuration, so the lock comes from PyPI alone whichever machine
# runs it (pip here is configured with local mirrors and find-links that other machines lack).
# pip then installs the lock in --require-hashes mode, which also fails on any dependency the
# lock leaves out. pip-compile would resolve through this machine's pip configuration.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

UV_VERSION=0.13.9
TOOL=build/lock-tool
LOCK=requirements.lock

say() { echo "lock: $*"; }
die() { echo "lock: ERROR: $*" >&2; exit 1; }

if [[ "$("$TOOL/bin/uv" --version 2>/dev/null)" != "uv $UV_VERSION "* ]]; then
    python=
    for candidate in .venv/bin/python python3.12 python3; do   # a pyenv shim may not run
        if "$candidate" -c 'import tomllib' 2>/dev/null; then python=$candidate; break; fi
    done
    [[ -n "$python" ]] || die "no Python >= 3.11 (.venv/bin/python, python3.12, python3)"
    rm -rf "$TOOL"
    "$python" -m venv "$TOOL" || die "$python -m venv $TOOL failed"
    "$TOOL/bin/python" -m pip install -q "uv==$UV_VERSION" \
        || die "pip install uv==$UV_VERSION failed"
    say "uv $UV_VERSION installed in $TOOL"
fi

# The inputs' digest goes below uv's header; uv reads the old file's pins as preferences.
digest=$("$TOOL/bin/python" tools/lock_inputs.py pyproject.toml)
"$TOOL/bin/uv" pip compile pyproject.toml --extra dev \
    --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
    --index-url https://pypi.org/simple --generate-hashes \
    --custom-compile-command "make lock" --quiet --output-file "$LOCK" "$@" \
    || die "uv pip compile failed (see above)"
{ sed -n '1,2p' "$LOCK"
  echo "# pyproject.toml dependencies sha256: $digest (tools/lock_inputs.py)"
  sed '1,2d' "$LOCK"; } >"$LOCK.tmp"
mv "$LOCK.tmp" "$LOCK"
say "$LOCK: $(grep -c '^[A-Za-z0-9]' "$LOCK") packages pinned; commit it with pyproject.toml"
