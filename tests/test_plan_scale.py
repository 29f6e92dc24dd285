"""Scale is correctness: ``mimo-inspect plan`` (and its advisor's workload) holds no Python
object per sample.

``make_plan`` (``run_plan``'s two dry runs of the epoch, balance none and tokens, and their
summaries) in process on N and 4N tiny text-only samples, two DP ranks of two TP ranks:
tracemalloc's traced peak grows by less than a stated bound per added sample, and each sample
is tokenized once. The datasets are opened before (their
token tables are the loader's, numpy, a few bytes a sample); the reviewer's RSS figures are
in the report of the fix.
"""

from __future__ import annotations

import argparse
import json
import tracemalloc
from pathlib import Path

from conftest import build_dataset
from mimo_data.inspect.plan import format_plan, make_plan
from mimo_data.inspect.workload import workload
from mimo_data.loading import dry_run
from mimo_data.loading.layout import Layout
from mimo_data.loading.loader import DataSource
from mimo_data.preprocess.config import PreprocessConfig

N = 1500
TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "smollm2"


def _records(count: int):
    for i in range(count):
        yield {"id": f"s{i}", "conversations": [
            {"from": "human", "value": f"Question {i % 50}?"},
            {"from": "gpt", "value": "Answer" + " a" * (i % 50)}]}


def _counting(text_batch, counts: list[int]):
    """`text_batch` that also appends how many records each call tokenizes to `counts`."""
    def counted(records):
        counts.append(len(records))
        return text_batch(records)
    return counted


def test_plan_memory_does_not_grow_per_sample(tmp_path, monkeypatch):
    # Before the fix: the reviewer measured ~2,400 B/sample of RSS (every micro-batch's keys
    # and token counts kept for the epoch, twice, then a dict per sample). Now ~100 measured
    # here: the loader's numpy epoch orders of both balances, made side by side (datasets,
    # positions, the balance's costs and their reordered copies; ~70 when made one after the
    # other); the plan's own figures are per step and per micro-batch (~5 B/sample).
    # With the dry run's micro-batches kept again (broken on purpose): ~500.
    config_path = tmp_path / "text.yaml"
    config_path.write_text(f"tokenizer: {TOKENIZER}\nmode: chat\nseq_length: 256\n"
                           "modalities: {}\n")
    config = PreprocessConfig.from_yaml(str(config_path))
    layout = Layout.parse("language=tp2,dp2")
    args = argparse.Namespace(global_batch_size=32, micro_batch_size=4, seed=0, epoch=0,
                              balance="none", packing=False, json=False)
    peaks, advisor, text = [], [], None
    for count in (N, 4 * N):
        data = tmp_path / f"data{count}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in _records(count)))
        build_dataset([data], tmp_path / f"shards{count}")
        source = DataSource([str(tmp_path / f"shards{count}")], config, text=text)
        text = source.metadata.text              # the tokenizer analysed once
        tokenized = []                           # records, a text_batch call at a time
        source.metadata.text_batch = _counting(source.metadata.text_batch, tokenized)
        tracemalloc.start()
        try:
            result, plan = make_plan(source, config, layout, args)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert result["checks"]["ok"] and result["steps_per_epoch"] == count // 32
        # each sample of the epoch read and tokenized once for the four ranks and both
        # balances, not once a rank's TP peer and balance: 4x (broken on purpose: the ranks'
        # loaders one after another)
        assert sum(tokenized) == count // 32 * 32, (sum(tokenized), count)
        printed = format_plan(result, plan)
        assert f"{count // 32} steps x 4 global micro-batches" in printed
        if count == N:          # the shared samples bounded (8 kept): more tokenized, same plan
            monkeypatch.setattr(dry_run, "SHARED_MIN", 8)
            monkeypatch.setattr(dry_run, "SHARED_TOKENS", 0)
            tokenized.clear()
            assert format_plan(*make_plan(source, config, layout, args)) == printed
            assert sum(tokenized) > count // 32 * 32, sum(tokenized)
            monkeypatch.undo()
        tracemalloc.start()                      # the advisor's workload: its first 8 steps
        try:
            read = workload(source, config, 32, 4)
            advisor.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert len(read["steps"]) == 8 and all(len(step) == 32 for step in read["steps"])
    grown = (peaks[1] - peaks[0]) / (3 * N)
    print(f"mimo-inspect plan: {grown:.0f} bytes a sample")
    assert grown < 128, f"mimo-inspect plan: {grown:.0f} bytes a sample"
    # the advisor (plan --model) read the whole epoch, a dict per sample: ~600 B a sample
    # (broken on purpose); now the micro-batches its 8 steps need: ~13
    grown = (advisor[1] - advisor[0]) / (3 * N)
    print(f"mimo-inspect plan --model: {grown:.0f} bytes a sample")
    assert grown < 128, f"mimo-inspect plan --model: {grown:.0f} bytes a sample"
