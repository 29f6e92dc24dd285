# The two entry points of the README. Each first runs tools/setup.sh, which installs whatever is
# missing (virtualenv, packages, Debian assets, tokenizer, sample corpus) and skips what is there.
PY := .venv/bin/python
DEMO := runs/demo

.PHONY: demo test setup

setup:
	@bash tools/setup.sh

demo: setup
	.venv/bin/mimo-shard build assets/corpus/llava.json assets/corpus/llava.jsonl \
	    assets/corpus/conversations.parquet assets/corpus/speech.parquet \
	    assets/corpus/speech_manifest.jsonl --output $(DEMO)/shards --overwrite \
	    --max-samples-per-shard 16 --workers 2
	.venv/bin/mimo-shard verify $(DEMO)/shards
	.venv/bin/mimo-shard info $(DEMO)/shards

# pytest exits 5 when it collected no test: that is a failure here, not a pass.
test: setup
	@$(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "test: pytest collected no tests" >&2; exit 1; fi; exit $$rc
