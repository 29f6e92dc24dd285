"""The loader in real multi-process jobs (forked ranks, gloo), one loader per rank: two jobs, of
two cases each (tests/jobs/loader_dist.py).

Run 1: 3 ranks, language dp2 + image dp1 (one DataLoader worker per rank), one epoch; the
ranks gather what they consumed and rank 0 checks exactly-once and cross-module order. Its
token table is computed split over the 3 ranks (into an empty cache directory): every rank
must end with the table one process computes alone.
Run 2: 4 ranks, language pp2 dp1 + image dp2 (another layout, another micro-batch), resumed
from the state run 1 saved after two steps: its steps must be run 1's remaining steps, keys
and tensors alike.
Run 1 again with ``--balance tokens --packing``: exactly once, every step with run 1's
samples, arranged otherwise; then resumed after two steps on 4 ranks (language dp2 + image dp2,
balanced and packed): the rest of the epoch, every step with its samples, none twice.
`mimo-inspect plan --json` for run 1's layout must predict exactly what run 1 consumed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import preprocess_config_file
from jobs.loader_dist import table_digest
from mimo_data.loading.token_table import TokenTable, compute
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.preprocessor import Preprocessor
from mimo_data.shards.reader import ShardReader

SCRIPT = Path(__file__).parent / "jobs" / "loader_dist.py"
GLOBAL_BATCH = 8
SAVE_AFTER = 2


def loader_job(ranks, nproc: int, logs: Path, *cases: list) -> None:
    """One job of tests/jobs/loader_dist.py running ``cases`` (argument lists) in turn."""
    argv: list = [SCRIPT]
    for case in cases:
        argv += [*(["+"] if len(argv) > 1 else []), "--global-batch-size", GLOBAL_BATCH,
                 "--seed", 21, *case]
    ranks.run(nproc, argv, logs).check()


@pytest.fixture(scope="module")
def jobs(ranks, loader_corpus, tmp_path_factory) -> dict:
    """Two jobs of two cases each. On 3 ranks: run 1 (language dp2 + image dp1, a token
    table computed split over the ranks into an empty cache) and run 1 balanced and packed.
    On 4 ranks, each resumed from the state its run saved after two steps: run 2 (language pp2
    + image dp2) and the balanced, packed resumption (language dp2 + image dp2)."""
    folder = tmp_path_factory.mktemp("dist")
    # Fixed-resolution images: the same token count for every image.
    config = preprocess_config_file(folder / "fixed.yaml",
                                    image={"policy": "fixed", "image_size": 112})
    common = ["--dataset", loader_corpus, "--config", config, "--micro-batch-size", 2]
    balanced = ["--balance", "tokens", "--packing"]
    loader_job(ranks, 3, folder / "job-3",
               [*common, "--out", folder / "first.json", "--layout", "language=dp2;image=dp1",
                "--workers", 1, "--save-after-steps", SAVE_AFTER, "--cache-dir",
                folder / "cache"],
               [*common, *balanced, "--out", folder / "balanced.json", "--layout",
                "language=dp2;image=dp1", "--workers", 1, "--save-after-steps", SAVE_AFTER])
    results = {name: json.loads((folder / f"{name}.json").read_text())
               for name in ("first", "balanced")}
    for name in ("first", "balanced"):
        (folder / f"{name}-state.json").write_text(json.dumps(results[name]["state"]))
    loader_job(ranks, 4, folder / "job-4",
               [*common, "--out", folder / "second.json", "--layout",
                "language=pp2,dp1;image=dp2", "--state", folder / "first-state.json"],
               [*common, *balanced, "--out", folder / "resumed.json", "--layout",
                "language=dp2;image=dp2", "--state", folder / "balanced-state.json"])
    for name in ("second", "resumed"):
        results[name] = json.loads((folder / f"{name}.json").read_text())
    results["first"]["cache"] = folder / "cache"
    return {**results, "config": config}


@pytest.fixture(scope="module")
def runs(jobs):
    return jobs["first"], jobs["second"], jobs["config"]


@pytest.fixture(scope="module")
def balanced(jobs) -> tuple[dict, dict]:
    """Run 1's job again with ``--balance tokens --packing``, and its resumption on 4 ranks."""
    return jobs["balanced"], jobs["resumed"]


def test_balanced_packed_epoch_serves_every_sample_once_with_each_steps_samples(runs,
                                                                                balanced):
    first, _, _ = runs
    whole, _ = balanced
    assert whole["problems"] == []             # exactly once, every module the same batches
    for module in ("language", "image"):
        plain, arranged = first["modules"][module], whole["modules"][module]
        assert [sorted(s["keys"]) for s in arranged] == [sorted(s["keys"]) for s in plain]
    assert [s["keys"] for s in whole["modules"]["language"]] != \
        [s["keys"] for s in first["modules"]["language"]]


def test_balanced_packed_resume_on_another_layout_serves_the_rest_once(balanced):
    whole, resumed = balanced
    assert resumed["problems"] == [] and resumed["world_size"] == 4
    for module in ("language", "image"):
        rest = whole["modules"][module][SAVE_AFTER:]
        assert [sorted(s["keys"]) for s in resumed["modules"][module]] == \
            [sorted(s["keys"]) for s in rest], module
        served = [key for s in whole["modules"][module][:SAVE_AFTER]
                  + resumed["modules"][module] for key in s["keys"]]
        assert sorted(served) == sorted(key for s in whole["modules"][module]
                                        for key in s["keys"]), module


def plan_per_module(plan: dict) -> dict:
    """Per module, per step: the keys of its global micro-batches (DP parts concatenated, in
    micro-batch order) as `mimo-inspect plan --json` predicts them."""
    parts: dict[str, dict[int, list]] = {}
    for rank in plan["ranks"]:
        for module in rank["role"]["modules"]:
            if module["tp_rank"] or module["cp_rank"] or module["pp_rank"] or not rank["steps"]:
                continue
            modality = next((m for m, name in rank["role"]["media"].items()
                             if name == module["module"]), None)
            parts.setdefault(module["module"], {})[module["dp_rank"]] = [
                [mb["encoder_keys"][modality] if modality else mb["keys"]
                 for mb in step["micro_batches"]] for step in rank["steps"]]
    return {name: [[key for mb in range(len(by_dp[0][step])) for dp in sorted(by_dp)
                    for key in by_dp[dp][step][mb]] for step in range(len(by_dp[0]))]
            for name, by_dp in parts.items()}


def test_one_epoch_on_three_ranks_serves_every_kept_sample_once(runs, loader_corpus):
    first, _, _ = runs
    assert first["problems"] == [] and first["world_size"] == 3
    kept = {f"0/{row['key']}" for row in pq.read_table(loader_corpus / "samples.parquet")
            .to_pylist() if not row["audio_duration"]}           # image-only config
    for module in ("language", "image"):
        steps = first["modules"][module]
        assert [s["step"] for s in steps] == list(range(len(kept) // GLOBAL_BATCH))
        served = [key for step in steps for key in step["keys"]]
        assert len(served) == len(set(served)) and set(served) <= kept
        assert len(kept - set(served)) == len(kept) % GLOBAL_BATCH
    assert [s["keys"] for s in first["modules"]["language"]] == \
        [s["keys"] for s in first["modules"]["image"]]
    assert {"/input_ids", "/labels"} <= set(first["modules"]["language"][0]["digests"])
    assert any(s["digests"] for s in first["modules"]["image"])
    assert (first["state"]["step"], first["state"]["micro_batch"]) == (SAVE_AFTER, 0)


def test_ranks_computing_parts_of_the_token_table_agree_with_one_process(runs, loader_corpus):
    first, _, config = runs
    alone = compute(ShardReader(str(loader_corpus)),
                    Preprocessor(PreprocessConfig.from_yaml(str(config)), with_media=False))
    expected = table_digest(TokenTable(alone, ["image"]))
    assert first["table_digests"] == [expected] * 3
    assert int((alone.column("drop").to_numpy() != 0).sum()) > 0    # drops are in it too
    written = list(first["cache"].rglob("tokens-*.arrow"))
    assert len(written) == 1 and not list(first["cache"].rglob("*.tmp-*"))


def test_resume_on_four_ranks_with_another_layout_continues_exactly(runs):
    first, second, _ = runs
    assert second["problems"] == [] and second["world_size"] == 4
    for module in ("language", "image"):
        assert second["modules"][module] == first["modules"][module][SAVE_AFTER:], module


def test_inspect_plan_predicts_what_the_torchrun_job_consumed(runs, loader_corpus, capsys):
    from mimo_data.inspect.cli import main
    first, _, config = runs
    capsys.readouterr()
    code = main(["plan", str(loader_corpus), "--config", str(config), "--layout",
                 "language=dp2;image=dp1", "--global-batch-size", str(GLOBAL_BATCH),
                 "--micro-batch-size", "2", "--seed", "21", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    predicted = plan_per_module(json.loads(out))
    consumed = {name: [step["keys"] for step in steps]
                for name, steps in first["modules"].items()}
    assert set(predicted) == set(consumed) == {"language", "image"}
    assert predicted == consumed
