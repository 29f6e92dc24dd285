# The two entry points of the README. Each first runs tools/setup.sh, which installs whatever is
# missing (virtualenv, packages, Debian assets, tokenizer, sample corpus) and skips what is there.
PY := .venv/bin/python
DEMO := runs/demo

.PHONY: demo test setup lock

setup:
	@bash tools/setup.sh

# Resolve pyproject.toml's dependencies again into requirements.lock (exact pins and hashes,
# which setup installs): after changing a dependency, or to upgrade, e.g.
# `make lock LOCK_ARGS=--upgrade` or LOCK_ARGS="--upgrade-package transformers". Commit the lock.
lock:
	@bash tools/lock.sh $(LOCK_ARGS)

# The main job: shard the sample corpus, check it (verify, inspect report: masks, token counts,
# drops), show where each sample goes, then train a tiny images + audio + language model for
# 30 steps under torchrun: 3 CPU processes, one per module (non-colocated), printing the loss;
# then the same for videos: build, inspect, and a tiny whole Qwen2-VL fine-tuned on 2 ranks.
demo: setup
	.venv/bin/mimo-shard build assets/corpus/llava.json assets/corpus/llava.jsonl \
	    assets/corpus/conversations.parquet assets/corpus/speech.parquet \
	    assets/corpus/speech_manifest.jsonl --output $(DEMO)/shards --overwrite \
	    --max-samples-per-shard 16 --workers 2
	.venv/bin/mimo-shard verify $(DEMO)/shards
	.venv/bin/mimo-shard info $(DEMO)/shards
	.venv/bin/mimo-inspect report $(DEMO)/shards --config configs/preprocess.yaml \
	    --html $(DEMO)/report.html
	.venv/bin/mimo-inspect plan $(DEMO)/shards --config configs/preprocess.yaml \
	    --layout "image=dp1;audio=dp1;language=dp1" --global-batch-size 8 --micro-batch-size 4 \
	    --packing
	rm -rf $(DEMO)/checkpoints
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 3 -m mimo_train \
	    --config configs/train/images_audio_noncolocated.yaml checkpoint.dir=$(DEMO)/checkpoints
	# Video: the corpus's clip conversations (the build refuses three bad clips of 12 records,
	# one clip of a single frame is too short to sample: 1 of 9 samples dropped, hence the
	# gate's two fractions),
	# then a whole tiny Qwen2-VL fine-tuned on them for 12 steps on 2 ranks, its one tower
	# serving images and videos.
	.venv/bin/mimo-shard build assets/corpus/video.jsonl --output $(DEMO)/video_shards \
	    --overwrite
	.venv/bin/mimo-inspect report $(DEMO)/video_shards \
	    --config configs/preprocess_qwen2_vl_video.yaml --max-dropped-fraction 0.12 \
	    --max-skipped-records-fraction 0.25 \
	    --html $(DEMO)/video_report.html
	rm -rf $(DEMO)/video_checkpoints
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 -m mimo_train \
	    --config configs/train/qwen2_vl_video_finetune.yaml \
	    checkpoint.dir=$(DEMO)/video_checkpoints
	@echo "demo: shards in $(DEMO)/shards and $(DEMO)/video_shards, HTML reports in" \
	    "$(DEMO)/report.html and $(DEMO)/video_report.html, checkpoints in" \
	    "$(DEMO)/checkpoints and $(DEMO)/video_checkpoints (the video run exports:" \
	    ".venv/bin/mimo-export --checkpoint $(DEMO)/video_checkpoints --output $(DEMO)/export)"

# Lint and types first (rules in pyproject.toml; a few seconds), then the suite on two workers
# (pytest-xdist), each taking whole test files (tests/README.md). pytest exits 5 when it
# collected no test: that is a failure here, not a pass.
test: setup
	.venv/bin/ruff check mimo_data mimo_train tools tests
	.venv/bin/mypy
	@$(PY) -m pytest -q -n 2 --dist loadfile; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "test: pytest collected no tests" >&2; exit 1; fi; exit $$rc
