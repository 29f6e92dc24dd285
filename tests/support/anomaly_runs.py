"""What tests/test_anomalies.py and tests/test_tracking.py share (no test module imports another):

- ``planted``: text-only shards of eleven short plain-English answers and one long random one
  (the planted key: 80 random vocabulary words, on which SmolLM2's loss is ~12), with a
  preprocessing config of SmolLM2's tokenizer and no modalities (a module fixture: a test
  module uses it by importing the name);
- ``train_planted``: ``mimo-train`` on forked ranks (``runs.train_job``) from the shipped
  ``images_language_colocated.yaml`` on the CPU without checkpoints: its exit status, its
  output and its records.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conftest import REPO, build_dataset, preprocess_config_file
from support.launch import Ranks
from support.runs import read_records, train_job

SMOLLM2 = REPO / "assets" / "models" / "smollm2-135m-instruct"
ANSWERS = ["Paris is the capital of France.", "Water boils at one hundred degrees.",
           "The sun rises in the east.", "Cats like to sleep in the sun.",
           "A week has seven days.", "Bread is made from flour.", "Snow is cold and white.",
           "Bees make honey from flowers.", "The moon goes around the earth.",
           "Trees grow from seeds.", "Rain falls from the clouds."]


def train_planted(ranks: Ranks, tmp: Path, name: str, *overrides: str, nproc: int = 1,
                  env: dict | None = None) -> tuple[int, str, list]:
    """(exit status, every rank's stdout and stderr, the records) of one run; exit status: the
    first rank's that failed, else 0."""
    job = train_job(ranks, tmp, name, "images_language_colocated.yaml", "train.device=cpu",
                    "checkpoint.dir=null", *overrides, nproc=nproc, env=env)
    logs = tmp / f"{name}-logs"
    output = "".join((logs / f"rank_{r}.out").read_text(errors="replace") + job.ranks[r]
                     for r in range(nproc))
    code = next((code for code in job.codes if code != 0), 0)
    return code, output, read_records(tmp / f"{name}.jsonl")


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[Path, Path, str]:
    """Text-only shards: eleven short answers and one long random one (the planted key)."""
    tmp = tmp_path_factory.mktemp("anomalies")
    import yaml
    from transformers import AutoTokenizer
    rng = random.Random(0)
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)      # 80 random words: loss ~12
    garbage = tokenizer.decode([rng.randrange(1000, 49000) for _ in range(80)])
    records = [{"id": f"plain-{i:02d}", "conversations": [
        {"from": "human", "value": "Tell me a fact."}, {"from": "gpt", "value": answer}]}
        for i, answer in enumerate(ANSWERS)]
    records.append({"id": "planted", "conversations": [
        {"from": "human", "value": "Tell me a fact."}, {"from": "gpt", "value": garbage}]})
    (tmp / "records.json").write_text(json.dumps(records))
    build_dataset([tmp / "records.json"], tmp / "shards")
    preprocess = preprocess_config_file(tmp / "preprocess.yaml")
    config = yaml.safe_load(preprocess.read_text())
    config.update(tokenizer=str(SMOLLM2), modalities={})
    preprocess.write_text(yaml.safe_dump(config))
    return tmp / "shards", preprocess, f"{len(ANSWERS):09d}"     # keys follow record order
