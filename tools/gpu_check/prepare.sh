#!/usr/bin/env bash
# Run here, from the project's root (set-up done): download into .whl/ the wheels the GPU
# machine lacks (it has torch 2.11 and transformers 5.x, no network; mimo needs 5.17+, which
# the check's packages step verifies), the versions this environment has, and
# flash-linear-attention (the gated delta-net's GPU kernels, Triton: not installed here), PyAV
# (the corpus's clips: 33 MiB), and the Qwen2-VL replica's tokenizer, template and processor
# files (its weights stay here: the cases' checkpoints are made there); keep .whl/ out of git.
# About 44 MiB, with assets/tokenizer and assets/corpus 52: the device call carries 64 MiB.
set -euo pipefail
[ -f pyproject.toml ] && [ -d mimo_train ] || { echo "run this from the project's root" >&2; exit 2; }
PY=${PY:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
rm -rf .whl && mkdir -p .whl
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
for name in megatron-core webdataset braceexpand soundfile cffi pycparser peft accelerate psutil av; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl "$name==$(version "$name")"
done
FLA_VERSION=0.6.0        # pure Python; megatron-core 0.19.2 imports its 0.6 paths
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl \
  "flash-linear-attention==$FLA_VERSION" "fla-core==$FLA_VERSION" einops
REPLICA=assets/models/published/Qwen--Qwen2-VL-2B-Instruct
mkdir .whl/"$(basename $REPLICA)"
find "$REPLICA" -maxdepth 1 -type f ! -name '*.safetensors' ! -name config.json ! -name '.*' \
  -exec cp {} .whl/"$(basename $REPLICA)"/ \;
du -shc .whl assets/tokenizer assets/corpus
echo "then on the GPU machine: python3 tools/gpu_check/run.py --out DIR --work /tmp/gcw" \
     "(carrying .whl, assets/tokenizer and assets/corpus; tools/gpu_check/README.md)"
