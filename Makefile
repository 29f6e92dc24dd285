# The two entry points of the README. Each first runs tools/setup.sh, which installs whatever is
# missing (virtualenv, packages, Debian assets, tokenizer, sample corpus) and skips what is there.
PY := .venv/bin/python
DEMO := runs/demo

.PHONY: demo test setup

setup:
	@bash tools/setup.sh

# Until mimo_train exists: shards, their check, what training would see (masks, counts,
# drops) and where each sample would go for a non-colocated 4-rank layout.
demo: setup
	.venv/bin/mimo-shard build assets/corpus/llava.json assets/corpus/llava.jsonl \
	    assets/corpus/conversations.parquet assets/corpus/speech.parquet \
	    assets/corpus/speech_manifest.jsonl --output $(DEMO)/shards --overwrite \
	    --max-samples-per-shard 16 --workers 2
	.venv/bin/mimo-shard verify $(DEMO)/shards
	.venv/bin/mimo-shard info $(DEMO)/shards
	.venv/bin/mimo-inspect report $(DEMO)/shards --config configs/preprocess.yaml \
	    --html $(DEMO)/report.html
	.venv/bin/mimo-inspect sample $(DEMO)/shards --config configs/preprocess.yaml --index 0
	.venv/bin/mimo-inspect plan $(DEMO)/shards --config configs/preprocess.yaml \
	    --layout "language=dp2;images=dp1;audio=dp1" --global-batch-size 8 --micro-batch-size 2
	@echo "demo: shards in $(DEMO)/shards, HTML report in $(DEMO)/report.html"

# pytest exits 5 when it collected no test: that is a failure here, not a pass.
test: setup
	@$(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "test: pytest collected no tests" >&2; exit 1; fi; exit $$rc
