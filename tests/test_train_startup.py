"""Bad configs fail at start-up with one clear message, never a hang: config errors before the
process groups exist, stub ranks, non-divisible batches, colocated fan-in with variable counts,
missing shards, a checkpoint.dir another run writes, a vocab smaller than the tokenizer,
encoder tp, unknown encoder modules, a missing pretrained encoder and ranks that read
different settings.

Every case runs for real on 3 ranks with gloo on the CPU, all of them in one ``torchrun`` job
(tests/jobs/startup_cases.py: each rank calls ``mimo_train.cli.main`` on each case in turn and
keeps what it printed to stderr, every warning shown each time, and its exit status): rank 0
prints one ``mimo-train: mimo_train start-up failed (PHASE)`` message naming the ranks, the
numbers or paths involved and the fix; the other ranks print nothing of it; no rank prints a
Python traceback or a third-party warning; every rank exits non-zero. Two cases also run as
the command line itself (``torchrun --standalone --nproc-per-node 3 -m mimo_train --config CFG
key=value ...``, each rank's whole stderr in its own file: ``--log-dir``, ``--redirects 3``),
one failing before the process groups exist and one after. A hang would run into the
launcher's timeout, which kills torchrun and every rank and fails the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
import yaml

from mimo_train.checkpoint_folders import MANIFEST
from mimo_train.components.checkpoint_owner import OWNER, _process

from conftest import REPO, build_dataset, preprocess_config_file
from support.launch import torchrun

NPROC = 3
# seconds: a hang fails the test instead of blocking the suite. Only a hang decides: a launch
# takes 30-60 s on the busy 2-core machine (four fresh interpreters importing torch), far
# below what any load stretches it to
TIMEOUT = 600

# The default preprocessing config's image section (dynamic resolution), for image-only files.
DYNAMIC_IMAGE = yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())[
    "modalities"]["image"]


@pytest.fixture(scope="module")
def preprocess(tmp_path_factory) -> dict:
    """Preprocessing configs: image + audio (the default; with M-RoPE positions; with audio at
    8 kHz), image only (dynamic resolution), image only (fixed 28 px, 4 tokens per image)."""
    tmp = tmp_path_factory.mktemp("startup-preprocess")
    mrope = preprocess_config_file(tmp / "p_mrope.yaml")
    mrope.write_text(yaml.safe_dump({**yaml.safe_load(mrope.read_text()), "positions": "mrope"}))
    modalities = yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())["modalities"]
    audio8k = preprocess_config_file(tmp / "p_8k.yaml", **{
        **modalities, "audio": {**modalities["audio"], "sample_rate": 8000}})
    return {"default": preprocess_config_file(tmp / "p.yaml"), "mrope": mrope, "audio8k": audio8k,
            "image": preprocess_config_file(tmp / "p_image.yaml", image=DYNAMIC_IMAGE),
            "fixed": preprocess_config_file(tmp / "p_fixed.yaml", image={
                "policy": "fixed", "image_size": 28, "patch_size": 14})}


def _base_config(tmp_path: Path, datasets, preprocess_file) -> Path:
    """A small model that would train as is with the default 3-rank layout."""
    config = {
        "data": {"datasets": [str(d) for d in datasets], "preprocess": str(preprocess_file)},
        "layout": "image=dp1;audio=dp1;language=dp1",
        "model": {"language": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2}},
        "optimizer": {"warmup_steps": 0},
        "train": {"steps": 1, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu"},
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _torchrun(tmp_path: Path, config: Path, overrides: list[str]):
    """Run the job; returns (exit code, {rank: its stderr}, torchrun's own output)."""
    job = torchrun(NPROC, ["-m", "mimo_train", "--config", config, *overrides],
                   timeout=TIMEOUT, log_dir=tmp_path / "logs")
    return job.codes[0], job.ranks, job.stdout + job.stderr


def _check_startup_failure(codes: list[int], ranks: dict, launcher: str, phase: str,
                           expected: list[str]):
    context = f"torchrun output:\n{launcher[-3000:]}\nrank stderr:\n" + "\n".join(
        f"--- rank {r}:\n{text[-3000:]}" for r, text in sorted(ranks.items()))
    assert all(code != 0 for code in codes), f"exit codes {codes} with a bad config\n{context}"
    assert sorted(ranks) == list(range(NPROC)), f"missing rank logs\n{context}"
    for rank, text in sorted(ranks.items()):
        assert "Traceback" not in text, f"rank {rank} printed a traceback\n{context}"
        assert "Warning" not in text, f"rank {rank} printed a warning\n{context}"
        assert "when instantiating" not in text, f"rank {rank} named a class\n{context}"
        if rank:
            assert "mimo-train" not in text and "start-up failed" not in text, \
                f"rank {rank} printed the start-up error too\n{context}"
    text = ranks[0]
    assert text.count("mimo-train: ") == 1, \
        f"rank 0 printed the start-up error {text.count('mimo-train: ')} times\n{context}"
    message = text[text.index("mimo-train: "):]
    assert f"mimo_train start-up failed ({phase})" in message, context
    # every rank failed for the same reason, and the message says so (unless the case names
    # the ranks: a check of what rank 0 alone writes)
    if not any(part.startswith("rank(s) ") for part in expected):
        assert f"rank(s) {list(range(NPROC))}:" in message, context
    for part in expected:
        assert part in message, f"{part!r} not in the message\n{context}"


# (id, preprocessing config, overrides, failing phase, substrings the user needs). Overrides
# and substrings may use {tmp}: the test's tmp_path.
CASES = [
    # -- stub ranks
    # -- a config error before the process groups exist (the ranks still agree)
    ("unknown key in an override", "default",
     ["train.stpes=3"], "config",
     ["TrainConfigError: unknown key(s) train.stpes", "known under train.: "]),
        ("two-rank layout on three ranks", "default",
     ["layout=image=dp1;language=dp1"], "config",
     ["ranks 2..2 are in no module", "image 1 + language 1 = 2 ranks", "the world has 3",
      "start 2 ranks under torchrun (--nnodes x --nproc-per-node = 2)"]),
    ("layout with a gap", "default",
     ["layout=image=dp1;audio=dp1,off2;language=dp1"], "config",
     ["ranks 1..1 are in no module", "gap before 'audio' at offset 2", "set its offset to 1"]),
    # -- non-divisible batches
    ("global batch not a multiple of micro batch x language dp", "image",
     ["layout=image=dp1;language=dp2", "train.global_batch_size=6"], "config",
     ["global batch 6 is not a multiple of micro batch 2 x language dp 2 = 4",
      "use a global batch that is a multiple of 4"]),
    ("encoder dp does not divide the global micro-batch", "image",
     ["layout=image=dp2;language=dp1", "train.micro_batch_size=1"], "config",
     ["module 'image' has dp 2", "global micro-batch of 1 sample ",
      "micro batch 1 x language dp 1", "make the micro batch a multiple of 2"]),
    # -- colocated modules of different dp with variable counts (megatron-core's colocated
    #    bridge splits evenly; non-colocated fan-in routes any counts)
    ("colocated fan-in of dynamic-resolution images", "image",
     ["layout=image=dp3,off0;language=tp3,off0", "train.micro_batch_size=3",
      "train.global_batch_size=6", "model.language.hidden_size=48",
      "model.language.num_attention_heads=3"], "config",
     ["colocated module 'image' (dp 3)", "variable token count", "'language' (dp 1)",
      "cannot span the language module's 3 ranks at dp 1",
      "put it on ranks of its own ('image=dp1;language=tp3', 4 ranks)", "policy: fixed"]),
    # -- outputs rank 0 writes, in a folder that cannot be made: both named, by rank 0
    ("records and tensorboard folders that cannot be made", "default",
     ["--records={tmp}/afile/records.jsonl", "train.tensorboard_dir={tmp}/afile/tb"], "config",
     ["rank(s) [0]: TrainConfigError: --records: {tmp}/afile is a file, not a folder",
      "train.tensorboard_dir: {tmp}/afile is a file, not a folder"]),
    # -- a cache folder that cannot be made: said in the config phase, not the data phase's
    ("a cache folder that cannot be made", "default",
     ["data.cache_dir={tmp}/afile/cache"], "config",
     ["data.cache_dir {tmp}/afile/cache cannot be made (Not a directory): give a folder this "
      "process can write to"]),
    # -- missing shards
    ("dataset directory does not exist", "default",
     ["data.datasets=[{tmp}/no-such-shards]"], "config",
     ["data.datasets: {tmp}/no-such-shards: no such directory (check the path: a dataset is "
      "the folder `mimo-shard build` or `mimo-shard index` wrote)"]),
    ("an Energon dataset's metadata folder", "default",
     ["data.datasets=[{tmp}/energon/.nv-meta]"], "config",
     ["data.datasets: {tmp}/energon/.nv-meta is the metadata folder of the Energon dataset "
      "{tmp}/energon, not a dataset mimo reads: index that dataset where it is (`mimo-shard "
      "index {tmp}/energon --output DIR`) and give DIR"]),
    ("a dataset at a URL whose scheme no storage client serves", "default",
     ["data.datasets=[s4://bucket/ds]"], "config",
     ["data.datasets: s4://bucket/ds: no storage client knows the scheme s4://"]),
    ("a dataset whose build wrote no sample", "default",
     ["data.datasets=[{tmp}/none]"], "config",
     ["data.datasets: {tmp}/none: no index.json: the build or indexing that wrote it kept no "
      "sample; {tmp}/none/report.json says why"]),
    ("a dataset whose index.json was deleted", "default",
     ["data.datasets=[{tmp}/unindexed]"], "config",
     ["data.datasets: {tmp}/unindexed: no index.json, so this is not a complete dataset (an "
      "interrupted build or indexing?)"]),
    ("a dataset's own file given for it", "default",
     ["data.datasets=[{tmp}/corpus/index.json]"], "config",
     ["data.datasets: {tmp}/corpus/index.json is a file, not a dataset's folder (index.json "
      "beside its tars): it is one of the dataset {tmp}/corpus's files; give that folder"]),
    ("a dataset given twice", "default",
     ["data.datasets=[{tmp}/corpus,{tmp}/corpus/]"], "config",
     ["data.datasets gives {tmp}/corpus twice: each of its samples would train twice an "
      "epoch; give it once (to draw from it more often, data.weights)"]),
    ("a validation set smaller than a global batch", "default",
     ["data.valid=[{tmp}/one]", "train.eval_interval=2"], "data",
     ["data.valid ({tmp}/one): an epoch holds 1 kept samples, fewer than one global batch"]),
    ("more samples dropped than data.max_dropped_fraction", "image",
     ["layout=image=dp1;language=dp2", "data.max_dropped_fraction=0.01"], "data",
     ["data.datasets: preprocessing drops 28 of the 69 samples of ",
      "more than data.max_dropped_fraction 0.01: ",
      "mimo-inspect report names them"]),
    ("a validation set whose item counts the colocated even split cannot take", "fixed",
     ["layout=image=dp3,off0;language=tp3,off0", "train.micro_batch_size=3",
      "train.global_batch_size=6", "model.language.hidden_size=48",
      "model.language.num_attention_heads=3", "data.datasets=[{tmp}/one-image]",
      "data.valid=[{tmp}/corpus]", "train.eval_interval=2"], "data",
     ["data.valid ({tmp}/corpus): colocated module 'image' (dp 3) feeds image into "
      "'language' (dp 1) through an even split", "sample(s) with 0"]),
    ("a validation set given twice", "default",
     ["data.valid=[{tmp}/corpus,{tmp}/corpus]", "train.eval_interval=2"], "config",
     ["data.valid gives {tmp}/corpus twice: each of its samples would count twice in the "
      "validation loss"]),
    ("dataset directory of tars without index.json", "default",
     ["data.datasets=[{tmp}/unfinished]"], "config",
     ["data.datasets: {tmp}/unfinished: tars with no index.json: tars made elsewhere",
      "`mimo-shard index {tmp}/unfinished --output DIR`",
      "a `mimo-shard build` that wrote them was interrupted: run it again"]),
    # -- a checkpoint.dir this run cannot take: said before the model is built (rank 0)
    ("a checkpoint.dir another run writes", "default",
     ["checkpoint.dir={tmp}/taken"], "config",
     ["rank(s) [0]: CheckpointError: checkpoint.dir {tmp}/taken is being written by another "
      "run (process ", "give this run another checkpoint.dir"]),
    ("resuming steps without latest", "default",
     ["checkpoint.dir={tmp}/earlier"], "config",
     ["rank(s) [0]: CheckpointError: checkpoint.dir {tmp}/earlier holds step_0000002 but no "
      "'latest' file"]),
    ("starting over among an earlier run's checkpoints", "default",
     ["checkpoint.dir={tmp}/earlier", "checkpoint.resume=false"], "config",
     ["rank(s) [0]: CheckpointError: checkpoint.dir {tmp}/earlier holds an earlier run's "
      "checkpoints (step_0000002) and checkpoint.resume is false"]),
    # -- vocab smaller than the tokenizer
    ("vocab smaller than the tokenizer", "default",
     ["model.language.vocab_size=1000"], "config",
     ["model.language.vocab_size 1000 is smaller than the tokenizer's 49154 tokens",
      "set it >= 49154 or leave it unset"]),
    # -- attention heads that do not split the width
    ("attention heads that do not divide the hidden size", "default",
     ["model.language.num_attention_heads=5"], "config",
     ["model.language.num_attention_heads 5 does not divide model.language.hidden_size 32",
      "give heads that divide it (e.g. 2, 4, 8)"]),
    # -- M-RoPE: the section must fit the heads, the positions must be M-RoPE ids
    ("mrope section that does not fit the heads", "default",
     ["model.language.mrope_section=[2,2,2]"], "config",
     ["model.language.mrope_section is [2, 2, 2]", "summing to head_dim / 2 = 8"]),
    ("mrope positions for a model without an mrope section", "mrope",
     [], "config",
     ["has positions: mrope", "model.language has no mrope_section",
      "set model.language.mrope_section"]),
    ("mrope section with sequential positions", "default",
     ["model.language.mrope_section=[2,3,3]"], "config",
     ["has positions: sequential", "has an mrope_section: set positions: mrope"]),
    # -- encoder modules the trainer cannot build
    ("encoder with tp2", "image",
     ["layout=image=tp2;language=dp1"], "config",
     ["encoder module 'image' has tp 2", "use dp only for encoders"]),
    ("model.encoders names a module the layout lacks", "default",
     ["model.encoders.foo.hidden_size=16"], "config",
     ["model.encoders has foo,", "does not name", "use its encoder modules"]),
    ("a pretrained audio encoder whose saved processor samples at another rate", "audio8k",
     [f"model.encoders.audio.pretrained={REPO / 'assets' / 'models' / 'tiny-whisper'}"],
     "config",
     ["encoder module 'audio': the audio processor saved in ",
      "preprocesses differently: sampling_rate 16000 (ours: modalities.audio.sample_rate 8000)",
      "set modalities.audio.sample_rate: 16000"]),
    ("pretrained encoder path does not exist", "default",
     ["model.encoders.image.pretrained=/nonexistent"], "config",
     ["model.encoders.image.pretrained", "/nonexistent"]),
    # another kind's checkpoint: found from its config, before anything is built
    ("pretrained encoder of another kind", "image",
     ["layout=image=dp1;language=dp2",
      f"model.encoders.image.pretrained={REPO / 'assets' / 'models' / 'tiny-siglip-vision'}"],
     "config",
     [f"model.encoders.image.pretrained {REPO / 'assets' / 'models' / 'tiny-siglip-vision'} "
      "is a 'siglip_vision_model' checkpoint, but module 'image' builds the qwen2_vl encoder",
      "which takes 'qwen2_vl_vision' checkpoints or a whole qwen2_vl model"]),
    # a config without its weights: found as the encoder is built, said without the class
    # megatron-core's build_module names (_check_startup_failure)
    ("pretrained encoder folder without weights", "image",
     ["layout=image=dp1;language=dp2", "model.encoders.image.pretrained={tmp}/no-weights"],
     "model",
     ["rank(s) [0]: OSError: Error no file named model.safetensors, or pytorch_model.bin, "
      "found in directory {tmp}/no-weights."]),
    # -- LoRA and per-module optimizer settings (braces doubled: the overrides are formatted)
    ("lora rank 0", "default",
     ["model.lora={{language: {{rank: 0}}}}"], "config",
     ["model.lora.language.rank is 0", "it must be >= 1"]),
    ("lora target that names no layer", "default",
     ["model.lora={{language: {{targets: [linear_qkvv]}}}}"], "config",
     ["model.lora.language.targets has 'linear_qkvv'", "names none of its linear layers",
      "decoder.layers.*.self_attention.linear_qkv"]),
    ("lora on a frozen part", "default",
     ["model.lora={{image.encoder: {{}}}}", "model.freeze=[image]"], "config",
     ["model.lora adapts 'image.encoder', which model.freeze freezes ('image')",
      "drop 'image' from model.freeze"]),
    ("optimizer settings of a frozen module", "default",
     ["model.freeze=[image]", "optimizer.modules={{image: {{lr: 0.5}}}}"], "config",
     ["optimizer.modules.image is set, but nothing of 'image' trains",
      "drop optimizer.modules.image, or 'image' from model.freeze"]),
    ("every module frozen", "default",
     ["model.freeze=[image, audio, language]"], "config",
     ["model.freeze freezes every module (image, audio, language): nothing would train"]),
    ("a frozen projection the model does not have", "default",
     ["model.projection=none", "model.freeze=[image.projection]"], "config",
     ["model.freeze freezes 'image.projection', which the model does not have "
      "(its projection is none)", "freeze 'image.encoder'"]),
    ("lora target of a tower that names no layer", "image",
     ["layout=image=dp1;language=dp2", "model.lora={{image.encoder: {{targets: [attn.qkvv]}}}}"],
     "model",
     ["model.lora.image.encoder.targets has 'attn.qkvv', which names none of its linear "
      "layers"]),
    ("lora rank that does not split over tp", "image",
     ["layout=image=dp1;language=tp2", "model.lora={{language: {{rank: 3}}}}"], "config",
     ["model.lora.language.rank 3 does not split over the language model's tp 2",
      "make it a multiple of 2"]),
    # -- memory settings the layout cannot take
    ("sequence parallel without language tp", "default",
     ["model.language.sequence_parallel=true"], "config",
     ["model.language.sequence_parallel needs the language model's tensor parallelism",
      "gives it tp1", "set tp >= 2"]),
    ("selective recompute of a tower", "default",
     ["model.encoders.image.recompute=selective"], "config",
     ["model.encoders.image.recompute is 'selective'", "use none or full"]),
    # -- ranks that read different configs ({{rank}}: each rank's number)
    ("ranks that read different settings", "default",
     ["train.seed={{rank}}"], "config",
     ["the ranks read different settings: rank(s) [0] and rank(s) [1, 2] differ (rank 0 vs "
      "rank 1: train.seed: 0 vs 1)", "every rank must read the same training and "
      "preprocessing configs", "Give every rank the same files"]),
    ("optimizer.modules names a module the layout lacks", "default",
     ["optimizer.modules={{vision: {{lr: 0.1}}}}"], "config",
     ["optimizer.modules has vision,", "use its modules"]),
]


def _case_id(case) -> str:
    name = case.values[0] if hasattr(case, "values") else case[0]
    return name.replace(" ", "-").replace(",", "")


def _case(case, tmp: Path) -> tuple[list[str], list[str]]:
    """A case's overrides and expected substrings with ``{tmp}`` filled in."""
    _, _, overrides, _, expected = case
    return ([o.format(tmp=tmp) for o in overrides], [e.format(tmp=tmp) for e in expected])


def _unfinished(tmp: Path, loader_corpus: Path) -> None:
    """Tars without an index: a WebDataset made elsewhere, or a bucket build interrupted."""
    unfinished = tmp / "unfinished"
    unfinished.mkdir()
    for shard in sorted(loader_corpus.glob("*.tar"))[:1]:
        (unfinished / shard.name).write_bytes(shard.read_bytes())


@pytest.fixture(scope="module")
def shared_job(tmp_path_factory, loader_corpus, preprocess) -> tuple[Path, dict, str]:
    """Every case in one 3-rank job: case name -> (exit codes by rank, stderr by rank)."""
    tmp = tmp_path_factory.mktemp("startup-cases")
    _unfinished(tmp, loader_corpus)
    (tmp / "afile").write_text("in the way\n")
    (tmp / "energon" / ".nv-meta").mkdir(parents=True)      # as `energon prepare` makes it
    (tmp / "energon" / ".nv-meta" / ".info.json").write_text('{"shard_counts": {}}\n')
    (tmp / "corpus").symlink_to(loader_corpus)          # the corpus under another name
    (tmp / "one.jsonl").write_text(json.dumps({"id": "only", "conversations": [
        {"from": "human", "value": "Hello?"}, {"from": "gpt", "value": "Hi."}]}) + "\n")
    build_dataset([tmp / "one.jsonl"], tmp / "one")     # a dataset of one sample
    photos = sorted((REPO / "assets" / "corpus" / "images").glob("*.jpg"))
    (tmp / "one-image.jsonl").write_text("".join(json.dumps(
        {"id": f"p{i}", "image": str(photo), "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"},
            {"from": "gpt", "value": "A photo."}]}) + "\n" for i, photo in enumerate(photos)))
    build_dataset([tmp / "one-image.jsonl"], tmp / "one-image")     # one image every sample
    (tmp / "none.jsonl").write_text(json.dumps({"id": "x", "image": "missing.jpg",
                                                "conversations": [
        {"from": "human", "value": "<image>\nHello?"}, {"from": "gpt", "value": "Hi."}]}) + "\n")
    build_dataset([tmp / "none.jsonl"], tmp / "none")   # every record skipped: a report
    shutil.copytree(tmp / "one", tmp / "unindexed")     # a whole build, its index deleted
    (tmp / "unindexed" / "index.json").unlink()
    (tmp / "taken").mkdir()             # claimed by a live process: this test's
    (tmp / "taken" / OWNER).write_text(json.dumps({
        "host": socket.gethostname(), "pid": os.getpid(), **_process(os.getpid())}))
    (tmp / "earlier" / "step_0000002").mkdir(parents=True)
    (tmp / "earlier" / "step_0000002" / MANIFEST).write_text("{}")
    (tmp / "no-weights").mkdir()
    shutil.copy(REPO / "assets" / "models" / "tiny-qwen2-vl-vision" / "config.json",
                tmp / "no-weights")
    configs = {}
    for kind, path in preprocess.items():
        (tmp / kind).mkdir()
        configs[kind] = _base_config(tmp / kind, [loader_corpus], path)
    argv = [["--config", str(configs[case[1]]), *_case(case, tmp)[0]] for case in CASES]
    (tmp / "cases.json").write_text(json.dumps(argv))
    out = tmp / "out"
    job = torchrun(NPROC, [REPO / "tests" / "jobs" / "startup_cases.py", tmp / "cases.json", out],
                   timeout=TIMEOUT * 2)
    launcher = job.stdout + job.stderr
    assert job.ok, f"the cases' job failed\n{launcher[-6000:]}"
    results = {}
    for index, case in enumerate(CASES):
        folder = out / str(index)
        results[case[0]] = ([int((folder / f"rank_{r}.code").read_text()) for r in range(NPROC)],
                            {r: (folder / f"rank_{r}.stderr").read_text() for r in range(NPROC)})
    return tmp, results, launcher


@pytest.mark.parametrize("name, preprocess_kind, overrides, phase, expected", CASES,
                         ids=[_case_id(case) for case in CASES])
def test_bad_config_fails_cleanly_on_every_rank(shared_job, name, preprocess_kind, overrides,
                                                 phase, expected):
    tmp, results, launcher = shared_job
    codes, ranks = results[name]
    _check_startup_failure(codes, ranks, launcher, phase,
                           _case((name, preprocess_kind, overrides, phase, expected), tmp)[1])


# one case that fails before the process groups exist, one after
COMMAND_LINE = [case for case in CASES if case[0] in (
    "unknown key in an override", "dataset directory does not exist")]


@pytest.mark.parametrize("name, preprocess_kind, overrides, phase, expected", COMMAND_LINE,
                         ids=[_case_id(case) for case in COMMAND_LINE])
def test_the_command_line_fails_cleanly_on_every_rank(tmp_path, loader_corpus, preprocess, name,
                                                       preprocess_kind, overrides, phase,
                                                       expected):
    _unfinished(tmp_path, loader_corpus)
    config = _base_config(tmp_path, [loader_corpus], preprocess[preprocess_kind])
    case_overrides, case_expected = _case((name, preprocess_kind, overrides, phase, expected),
                                          tmp_path)
    code, ranks, launcher = _torchrun(tmp_path, config, case_overrides)
    assert sorted(ranks) == list(range(NPROC)), f"missing rank logs\n{launcher[-3000:]}"
    _check_startup_failure([code], ranks, launcher, phase, case_expected)
    # torchrun's report names the failure as its root cause, not "<N/A>"
    assert "error_file: <N/A>" not in launcher and \
        f"start-up failed ({phase})" in launcher.split("Root Cause")[-1], launcher[-3000:]


@pytest.mark.parametrize("this_rank", [1, 2])
def test_a_bug_on_some_ranks_is_one_gathered_failure(monkeypatch, capsys, this_rank):
    """An exception that is no config or data error (megatron-core's assert while building a
    layer) on ranks 1 and 2 only: every rank still joins the gather (rank 0 would otherwise
    wait in it for ranks that left) and raises the one start-up failure naming both, exit
    status 1; rank 1, the first it happened on, prints its traceback (in process: the gather
    gives ranks 1 and 2 this rank's failure)."""
    from mimo_train.errors import StartupError
    from mimo_train.runtime import console, distributed

    def build():
        raise AssertionError("131 is not divisible by 2")
    monkeypatch.setattr(distributed, "gather", lambda error: [None, error, error])
    monkeypatch.setattr(distributed, "barrier", lambda: None)
    monkeypatch.setenv("RANK", str(this_rank))
    with pytest.raises(StartupError) as failed:
        console.agree("model", build)
    assert str(failed.value) == ("mimo_train start-up failed (model):\n  rank(s) [1, 2]: "
                                 "AssertionError: 131 is not divisible by 2")
    assert failed.value.exit_code == 1
    printed = capsys.readouterr().err
    assert ("Traceback" in printed) == (this_rank == 1), printed


def test_a_store_that_kept_failing_at_start_up_exits_1(monkeypatch):
    """The config phase's look-up of a dataset in a bucket that keeps failing, or whose
    credentials are refused (a StorageError): exit status 1, as the README's table and
    docs/storage.md say (and as mimo-shard exits), not 2, a config error's."""
    from mimo_data.shards.storage import StorageError
    from mimo_train.errors import StartupError
    from mimo_train.runtime import console, distributed

    def check():
        raise StorageError("looking up s3://b/ds/index.json (endpoint http://127.0.0.1:9): "
                           "access denied (PermissionError: Forbidden)")
    monkeypatch.setattr(distributed, "gather", lambda error: [error, error])
    monkeypatch.setattr(distributed, "barrier", lambda: None)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(StartupError) as failed:
        console.agree("config", check)
    assert "StorageError: looking up s3://b/ds/index.json" in str(failed.value)
    assert failed.value.exit_code == 1


def test_an_error_gathered_already_is_said_by_the_ranks_it_names(monkeypatch):
    """The token table's error (made on every rank from what each rank's share raised: a shard
    missing where rank 0 read, the same copy on every rank) is said with the ranks it
    happened on, not as a TableError of every rank wrapping it."""
    from mimo_data.loading.token_table import Partition
    from mimo_train.errors import StartupError
    from mimo_train.runtime import console, distributed

    missing = "DatasetError: /data: shard data-000000.tar missing: run `mimo-shard verify /data`"
    shares = [(None, missing), (None, None), (None, missing)]
    partition = Partition(1, 3, lambda mine: shares, writes=False)
    monkeypatch.setattr(distributed, "gather", lambda error: [error] * 3)
    with pytest.raises(StartupError) as failed:
        console.agree("data", lambda: partition.together(lambda: None))
    assert str(failed.value) == f"mimo_train start-up failed (data):\n  rank(s) [0, 2]: {missing}"


def test_a_data_loader_workers_error_is_its_own_message_without_the_workers_traceback():
    """A DataLoader worker's error comes back with the worker's traceback in its message, its
    last line naming the class with its module: the run's one message is that error's own."""
    from torch._utils import ExceptionWrapper

    from mimo_data.shards.index import DatasetError
    from mimo_train.runtime.console import run_failure
    try:
        raise DatasetError("shard-000001.tar is cut short at sample 7's jpg: verify the dataset")
    except DatasetError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(DatasetError) as raised:
        wrapped.reraise()
    assert "Original Traceback" in str(raised.value)
    failure = run_failure(raised.value, 0, "step 1", "image dp rank 0")
    assert str(failure) == ("training stopped in step 1 on rank 0 (image dp rank 0): "
                            "DatasetError: shard-000001.tar is cut short at sample 7's jpg: "
                            "verify the dataset") and not failure.details


@pytest.mark.parametrize("raised, says", [
    # gloo's words for a peer that did not come within the collective's timeout
    ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
     "60000ms for recv operation to complete",
     "a collective waited train.collective_timeout_minutes for another rank, which did not "
     "come: a rank stalled"),
    # torch's DataLoader, for a worker the kernel's out-of-memory killer ended
    ("DataLoader worker (pid 4242) is killed by signal: Killed. ",
     "a data loader worker of this rank died: DataLoader worker (pid 4242) is killed by "
     "signal: Killed. (the kernel's out-of-memory killer? lower data.num_workers"),
    # ... and for one that ran out of shared memory (a container's 64 MB /dev/shm)
    ("DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that "
     "dataloader's workers are out of shared memory. Please try to raise your shared memory "
     "limit.",
     "a data loader worker of this rank died: DataLoader worker (pid 4242) is killed by "
     "signal: Bus error. (out of shared memory: give the job a larger /dev/shm"),
    ("DataLoader worker (pid(s) 4242, 4243) exited unexpectedly",
     "a data loader worker of this rank died: DataLoader worker (pid(s) 4242, 4243) exited "
     "unexpectedly"),
])
def test_a_stalled_rank_and_a_dead_loader_worker_are_said_not_reported_as_bugs(raised, says):
    from mimo_train.runtime.console import run_failure
    failure = run_failure(RuntimeError(raised), 1, "step 3", "language dp rank 0")
    assert str(failure).startswith("training stopped in step 3 on rank 1 (language dp rank 0): "
                                   + says), str(failure)
    assert not failure.details and not failure.peer_lost     # no traceback: not a bug


def test_a_rank_that_left_during_start_up_is_one_message_not_a_traceback(monkeypatch):
    """A peer gone while the ranks agree on a start-up phase (a signal before the run's
    handlers are up, the out-of-memory killer): the agreement's failure is the one message
    the job prints, saying so; another failure of the agreement stays what it is."""
    from mimo_train.errors import RunError
    from mimo_train.runtime import console, distributed

    def gone(error):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                           "reset by peer\nException raised from recvFrom")
    monkeypatch.setattr(distributed, "gather", gone)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RunError) as failed:
        console.agree("model", lambda: None)
    assert failed.value.peer_lost and str(failed.value).startswith(
        "start-up stopped in its model phase on rank 0: another rank left the job without a "
        "message ([../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by "
        "peer): killed, out of memory, or a signal before training began")

    def broken(error):
        raise ValueError("a bug of the gather's own")
    monkeypatch.setattr(distributed, "gather", broken)
    with pytest.raises(ValueError, match="a bug of the gather's own"):
        console.agree("model", lambda: None)


@pytest.mark.parametrize("datasets", [["s3://bucket/ds", "S3://bucket//ds/"],
                                      ["gs://bucket/ds", "gcs://bucket/ds"]])
def test_a_bucket_dataset_given_twice_in_two_spellings_is_refused(datasets):
    from types import SimpleNamespace

    from mimo_train.errors import TrainConfigError
    from mimo_train.training.start_checks import _check_each_once
    config = SimpleNamespace(data=SimpleNamespace(datasets=datasets, valid=[], weights=None))
    with pytest.raises(TrainConfigError, match=f"data.datasets gives {datasets[1]} twice "
                       rf"\(first as {datasets[0]}\)"):
        _check_each_once(config)
    _check_each_once(SimpleNamespace(data=SimpleNamespace(datasets=datasets[:1] + [
        datasets[0] + "-other"], valid=[], weights=None)))  # two datasets: nothing to say
    # one string object twice (a YAML anchor, [*d, *d]): the same
    same = yaml.safe_load("- &d s3://bucket/ds\n- *d\n")
    assert same[0] is same[1]
    with pytest.raises(TrainConfigError, match="data.datasets gives s3://bucket/ds twice: "):
        _check_each_once(SimpleNamespace(data=SimpleNamespace(datasets=same, valid=[],
                                                              weights=None)))
    # the dry run's and mimo-inspect's DataSource refuses it alike, before opening anything
    from mimo_data.loading.loader import DataSource
    with pytest.raises(ValueError, match=re.escape(
            f"{datasets[1]} twice (first as {datasets[0]}) given: each of its samples would "
            "be drawn twice an epoch; give it once, with a larger weight")):
        DataSource(datasets, REPO / "configs" / "preprocess.yaml", weights=[1, 3])


def test_a_cache_dir_that_takes_no_tables_is_refused_in_the_config_phase(tmp_path,
                                                                        monkeypatch):
    from mimo_train.errors import TrainConfigError
    from mimo_train.training.start_checks import _check_cache_dir
    monkeypatch.delenv("MIMO_CACHE_DIR", raising=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(TrainConfigError, match=f"data.cache_dir {tmp_path}/file/c cannot be "
                       r"made \(Not a directory\): give a folder this process can write to"):
        _check_cache_dir(str(tmp_path / "file" / "c"))
    _check_cache_dir(str(tmp_path / "made"))
    assert (tmp_path / "made").is_dir()
    monkeypatch.setenv("MIMO_CACHE_DIR", str(tmp_path))     # which replaces it: not looked at
    _check_cache_dir(str(tmp_path / "file" / "c"))


def test_a_copy_of_a_dataset_given_beside_it_is_refused(tmp_path, loader_corpus):
    """Two folders of one list whose index.json are the same bytes (a dataset and its copy,
    under any paths): refused as one dataset given twice; two datasets are not."""
    from types import SimpleNamespace

    from mimo_train.errors import TrainConfigError
    from mimo_train.training.start_checks import _check_no_copies
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(loader_corpus / "index.json", copy)

    def config(datasets, valid=(), weights=None):
        return SimpleNamespace(data=SimpleNamespace(
            datasets=[str(d) for d in datasets], valid=[str(d) for d in valid],
            storage_options=None, weights=weights))
    same = f"gives {loader_corpus} and {copy}, whose index.json are the same (a copy of one " \
        "dataset): each of its samples "
    with pytest.raises(TrainConfigError) as refused:
        _check_no_copies(config([loader_corpus, copy]))
    assert str(refused.value) == f"data.datasets {same}would train twice an epoch; give it " \
        "once, and to draw from it more often, data.weights"
    with pytest.raises(TrainConfigError) as refused:
        _check_no_copies(config([loader_corpus], [loader_corpus, copy]))
    assert str(refused.value) == f"data.valid {same}would count twice in the validation " \
        "loss; give it once"
    # the loader's DataSource (the dry run's, mimo-inspect's, a user's own) refuses it alike,
    # before its token tables (it drew each sample twice an epoch)
    from mimo_data.loading.loader import DataSource
    whole = shutil.copytree(loader_corpus, tmp_path / "whole")
    with pytest.raises(ValueError) as refused:
        DataSource([loader_corpus, whole], REPO / "configs" / "preprocess.yaml")
    assert str(refused.value) == (
        f"{loader_corpus} and {whole}, whose index.json are the same (a copy of one dataset) "
        "given: each of its samples would be drawn twice an epoch; give it once (to draw from "
        "it more often, weights)")
    assert DataSource([loader_corpus, whole], REPO / "configs" / "preprocess.yaml",
                      weights=[1, 0]).weights == [1.0, 0.0]    # weight 0: draws nothing
    # an index of one of its shards (read in place, say): that shard's samples twice
    index = json.loads((copy / "index.json").read_text())
    shard = index["shards"][1]
    index["shards"] = [shard]
    index["shard_root"] = str(loader_corpus)
    (copy / "index.json").write_text(json.dumps(index))
    with pytest.raises(TrainConfigError) as refused:
        _check_no_copies(config([loader_corpus, copy]))
    assert str(refused.value) == (
        f"data.datasets gives {loader_corpus} and {copy}, which both hold shard "
        f"{shard['name']} (the same bytes: two indexes of the same tars, or a copy): its "
        f"{shard['samples']} samples would train twice an epoch; give each shard in one "
        "dataset (mimo-shard index takes a list of tars)")
    # ... unless one of them draws nothing (weight 0), or reads the tar otherwise (an index
    # of its long captions beside one of its short ones: other samples)
    _check_no_copies(config([loader_corpus, copy], weights=[1, 0]))
    index["build"] = {"members": {"layout": "pairs", "text": "long"}}
    (copy / "index.json").write_text(json.dumps(index))
    beside = tmp_path / "short"
    beside.mkdir()
    (beside / "index.json").write_text(json.dumps({**index, "build": {
        "members": {"layout": "pairs", "text": "txt"}}}))
    _check_no_copies(config([beside, copy]))
    (beside / "index.json").write_text(json.dumps({**index, "build": {
        "members": {"text": "long", "layout": "pairs"}}, "name": "again"}))
    with pytest.raises(TrainConfigError, match=f"gives {beside} and {copy}, which both hold "
                       f"shard {shard['name']}"):
        _check_no_copies(config([beside, copy]))
    # two tars of the same bytes in one dataset (its own to hold): not said as two datasets
    (beside / "index.json").write_text(json.dumps({**index, "shards": [
        {**shard, "sha256": "1" * 64}, {**shard, "name": "again.tar", "sha256": "1" * 64}]}))
    _check_no_copies(config([beside, copy]))
    shard["sha256"] = "0" * 64                              # another dataset: nothing to say
    (copy / "index.json").write_text(json.dumps(index))
    _check_no_copies(config([loader_corpus, copy], [loader_corpus, copy]))


def test_the_settings_the_ranks_compare_leave_out_what_a_node_sets_its_own_way():
    """``RunPlan.given`` (what the ranks' start-up compares: a case above): a node's own cache
    folder, storage options and what rank 0 alone writes (TensorBoard, a W&B run's name) may
    differ between the nodes' launches; the seed, a dataset or the preprocessing may not."""
    from types import SimpleNamespace

    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.config import TrainConfig
    from mimo_train.plan.run_plan import RunPlan

    def given(*overrides):
        cfg = TrainConfig.load(str(REPO / "configs" / "train" /
                                   "images_language_colocated.yaml"), list(overrides))
        preprocess = PreprocessConfig.from_yaml(cfg.data.preprocess)
        return RunPlan.given(SimpleNamespace(config=cfg, preprocess=preprocess))

    node = given("data.cache_dir=/local/a", "train.tensorboard_dir=tb-a",
                 "train.wandb={project: p, name: run-0900}", "data.storage_options={key: a}")
    assert node == given("data.cache_dir=/local/b", "train.tensorboard_dir=tb-b",
                         "train.wandb={project: p, name: run-0901}")
    assert node != given("train.seed=2") and node["train.seed"] == "1"
    assert node["preprocess.seq_length"] == repr(PreprocessConfig.from_yaml(
        str(REPO / "configs" / "preprocess_images.yaml")).seq_length)


def test_one_process_for_a_layout_of_several_ranks_is_told_to_use_torchrun(monkeypatch):
    """``python -m mimo_train`` (no launcher: one process) for a layout of three ranks: the
    layout's refusal ends with the torchrun command, which a launched rank is not told."""
    from mimo_data.loading.layout import Layout, LayoutError
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.config import TrainConfig
    from mimo_train.training import start_checks
    layout = Layout.parse("language=dp2;image=dp1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(start_checks.dist, "get_world_size", lambda: 1)
    assert start_checks._alone(layout) == (
        " (this is one process, started without torchrun; on this machine: torchrun "
        "--standalone --nproc-per-node 3 -m mimo_train ...)")
    monkeypatch.setenv("RANK", "0")
    assert start_checks._alone(layout) == ""
    # a layout unsound on any world (two modules on the language model's ranks): its own
    # refusal alone, no torchrun command for a world of the broken layout's size
    monkeypatch.delenv("RANK")
    cfg = TrainConfig.load(str(REPO / "configs" / "train" / "images_audio_colocated.yaml"))
    preprocess = PreprocessConfig.from_yaml(cfg.data.preprocess)
    broken = Layout.parse("language=tp2,dp1;image=dp1,off0;audio=dp1,off0")
    with pytest.raises(LayoutError) as refused:
        start_checks.check_layout(cfg, preprocess, broken)
    assert "audio's offset to 3" in str(refused.value) and "torchrun" not in \
        str(refused.value), refused.value
    with pytest.raises(LayoutError, match=r"--nproc-per-node 4 -m mimo_train"):
        start_checks.check_layout(cfg, preprocess, Layout.parse(
            "language=tp2,dp1;image=dp1,off2;audio=dp1,off3"))
