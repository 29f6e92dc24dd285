"""What every mimo CLI promises: one exit-status table (0 ok, 1 a check or the data failed,
2 usage or config error), help text for every option, a light import for ``--help``, and a
quiet end when its output's reader goes (``| head``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import TextIO

import pytest
import yaml

from conftest import MODELS, REPO, build_dataset, write_jsonl
from support.launch import python

CLIS = {"mimo-shard": "mimo_data.shards.cli", "mimo-inspect": "mimo_data.inspect.cli"}
# command lines without subcommands
SINGLE_CLIS = {"mimo-export": "mimo_train.hf.export", "mimo-generate": "mimo_train.hf.generate"}


def _parser(module: str) -> argparse.ArgumentParser:
    return __import__(module, fromlist=["_parser"])._parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _main(module: str, capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of the CLI's main in-process; argparse's exits count too."""
    main = __import__(module, fromlist=["main"]).main
    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_every_option_of_every_subcommand_has_help(cli):
    parser = _parser(CLIS[cli])
    commands = _subparsers(parser)
    assert commands, f"{cli} has no subcommands"
    missing = [f"{name}: {action.option_strings or action.dest}"
               for name, sub in [("", parser), *commands.items()] for action in sub._actions
               if not (action.help or "").strip() or action.help == argparse.SUPPRESS]
    assert not missing, f"{cli} options without help: {missing}"


@pytest.mark.parametrize("cli", sorted(SINGLE_CLIS))
def test_every_option_of_every_single_command_cli_has_help(cli):
    parser = _parser(SINGLE_CLIS[cli])
    missing = [action.option_strings or action.dest for action in parser._actions
               if not (action.help or "").strip() or action.help == argparse.SUPPRESS]
    assert not missing, f"{cli} options without help: {missing}"


@pytest.mark.parametrize("cli, args", [
    ("mimo-export", ["--checkpoint", "x"]),                      # --output missing
    ("mimo-export", ["--checkpoint", "x", "--output", "y", "--dtype", "fp8"]),
    ("mimo-generate", ["--model", "x"]),                         # --prompt missing
    ("mimo-generate", ["--model", "x", "--prompt", "Hi", "--max-new-tokens", "0"]),
    ("mimo-generate", ["--model", "x", "--prompt", "Hi", "--temperature", "-1"]),
    ("mimo-generate", ["--model", "x", "--prompt", "Hi", "--device", "tpu"]),
])
def test_single_command_usage_errors_exit_2(capsys, cli, args):
    code, err = _main(SINGLE_CLIS[cli], capsys, *args)
    assert code == 2 and err.strip()
    if "--dtype" in args:                       # the names it takes, the short ones too
        assert "give one of float32, bfloat16, float16 (or fp32, bf16, fp16)" in err, err


# what mimo-shard's commands import once their arguments are parsed (mimo_data.shards.cli)
# mimo-shard's commands that read metadata alone (run on the dataset: {dataset})
METADATA_COMMANDS = [["info", "{dataset}"], ["cache", "{dataset}"]]
SHARD_COMMANDS = ["mimo_data.shards.build", "mimo_data.shards.in_place", "mimo_data.shards.info",
                  "mimo_data.shards.verify", "mimo_data.shards.cache_entries"]
# image (dynamic) and audio; image (fixed, CLIP's short side); video (none in the corpus)
IMPORT_CONFIGS = ["preprocess.yaml", "preprocess_llava.yaml", "preprocess_qwen2_vl_video.yaml"]


def test_importing_the_clis_imports_nothing_heavy(corpus_build):
    """In a fresh interpreter (what a process imports: not a forked rank's,
    tests/jobs/imports.py): the CLIs, for ``--help``, import nothing heavy; mimo-shard's
    commands then import no transformers (seconds and ~80 MiB with torchvision: only
    preprocessing sizes media); a ``Preprocessor`` imports what its modalities use up front,
    so preprocessing the corpus's images and audio after it imports nothing more (what the
    loader's forked workers would each import again). `mimo-shard info` and `cache` read
    metadata and import no torch (2 s and ~600 MB of a 0.4 s command, as webdataset's import
    of torch had made them)."""
    configs = [str(REPO / "configs" / name) for name in IMPORT_CONFIGS]
    asked = {"clis": [*CLIS.values(), *SINGLE_CLIS.values(), "mimo_train.inspect_cli",
                      "mimo_train.cli"],
             "metadata": [[arg.format(dataset=corpus_build) for arg in command]
                          for command in METADATA_COMMANDS],
             "commands": SHARD_COMMANDS,
             "dataset": str(corpus_build), "every": 5,
             "configs": configs}
    result = python([REPO / "tests" / "jobs" / "imports.py", json.dumps(asked)]).check()
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["clis"] == [], found
    assert "torch" not in found["metadata"] and "webdataset" not in found["metadata"], found
    assert "transformers" not in found["commands"], found
    for config in configs:
        assert found["configs"][config]["imported"] == [], (config, found)
    counts = [found["configs"][config]["items"] for config in configs]
    assert counts[0]["image"] and counts[0]["audio"] and counts[1]["image"], found


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_usage_errors_exit_2(capsys, tmp_path, cli):
    module = CLIS[cli]
    code, err = _main(module, capsys, "no-such-command")
    assert code == 2 and "invalid choice" in err
    sub = "build" if cli == "mimo-shard" else "report"
    code, err = _main(module, capsys, sub)                      # required arguments missing
    assert code == 2 and "required" in err
    # a required option mistyped: the typo named first (argparse checks required options
    # first: "--output" missing, the typo never said), with the option meant
    typo, meant = ("--ouput", "--output") if cli == "mimo-shard" else ("--confg", "--config")
    code, err = _main(module, capsys, sub, "a", typo, "x")
    assert code == 2 and f"unrecognized arguments: {typo} (did you mean {meant}?)" in err, err
    if cli == "mimo-inspect":      # a cut-short option where abbreviations are off: named too
        code, err = _main(module, capsys, sub, "a", "--confi", "x")
        assert code == 2 and "unrecognized arguments: --confi (did you mean --config?)" in err, err
    # a subcommand's own option mistyped, nothing required missing: argparse leaves it to the
    # top parser, which knows none of the subcommand's options; the closest one is named
    typo, meant = ("--jsno", "--json") if cli == "mimo-shard" else ("--limt", "--limit")
    code, err = _main(module, capsys, sub if cli != "mimo-shard" else "info", tmp_path, typo,
                      *(() if cli == "mimo-shard" else ("--config", "x")))
    assert code == 2 and f"unrecognized arguments: {typo} (did you mean {meant}?)" in err, err
    # several unknown options: each with a close one named
    code, err = _main(module, capsys, sub if cli != "mimo-shard" else "info", tmp_path, "--fast",
                      typo, *(() if cli == "mimo-shard" else ("--config", "x")))
    assert code == 2 and f"unrecognized arguments: --fast {typo} (did you mean {typo} -> " \
        f"{meant}?)" in err, err
    code, err = _main(module, capsys, "info" if cli == "mimo-shard" else "report",
                      tmp_path / "missing", *(() if cli == "mimo-shard" else
                                              ("--config", REPO / "configs" / "preprocess.yaml")))
    assert code == 2 and "missing" in err
    if cli == "mimo-inspect":       # datasets of a mix given at once: one at a time, said
        config = REPO / "configs" / "preprocess.yaml"
        for given in (("report", "a", "b", "--config", config),
                      ("report", "a", "--config", config, "b"), ("plan", "a", "b", "c")):
            code, err = _main(module, capsys, *given)
            assert code == 2 and f"mimo-inspect {given[0]}: error: it reads one dataset, " \
                f"{3 if given[-1] == 'c' else 2} were given" in err, err
        code, err = _main(module, capsys, "sample", "a", "42", "--config", config)
        assert code == 2 and "a sample is chosen with --key KEY or --index N" in err, err
        # two preprocessing configs: refused (exit 2), not the last one silently, and a second
        # YAML after --config is no second dataset
        other = REPO / "configs" / "preprocess_llava.yaml"
        for given in (("sample", "a", "--config", config, "--config", other),
                      ("report", "a", "--config", config, other)):
            code, err = _main(module, capsys, *given)
            assert code == 2 and "one preprocessing config" in err and "dataset, 2" not in err, err
        code, err = _main(module, capsys, "report", "a", "--config", config, "--jsn", "x")
        assert code == 2 and "unrecognized arguments: --jsn x" in err, err
        # the subcommand's usage; a launch gate's thresholds by their exact names only
        assert "usage: mimo-inspect report " in err, err
        code, err = _main(module, capsys, "report", "a", "--config", config, "--max-drop", "1")
        assert code == 2 and "unrecognized arguments: --max-drop 1" in err, err
        code, err = _main(module, capsys, "report", "a", "--config", config,
                          "--max-dropped-fraction", "abc")
        assert code == 2 and "argument --max-dropped-fraction: invalid fraction value: " \
            "'abc'" in err, err


def test_shard_bad_options_and_inputs_exit_2(capsys, tmp_path, good_records):
    source = write_jsonl(tmp_path / "in.jsonl", good_records)
    module = CLIS["mimo-shard"]
    code, err = _main(module, capsys, "build", source, "-o", tmp_path / "a",
                      "--max-samples-per-shard", "0", "--no-progress", "--workers", "0")
    assert code == 2 and "argument --max-samples-per-shard: 0 is below 1" in err
    # --workers below 0, by every subcommand that takes it (verify had taken -3)
    for command in (["build", source, "-o", tmp_path / "a"], ["index", tmp_path, "-o",
                                                               tmp_path / "a"],
                    ["verify", tmp_path]):
        code, err = _main(module, capsys, *command, "--workers", "-3")
        assert code == 2 and "argument --workers: -3 is below 0" in err, err
        if command[0] != "verify":   # a pixel limit of 0 or less skipped every image
            code, err = _main(module, capsys, *command, "--max-image-pixels", "-5")
            assert code == 2 and "argument --max-image-pixels: -5 is below 1" in err, err
    code, err = _main(module, capsys, "build", tmp_path / "nope.jsonl", "-o", tmp_path / "b",
                      "--no-progress", "--workers", "0")
    assert code == 2 and "not found" in err
    code, err = _main(module, capsys, "build", source, "-o", tmp_path / "c",
                      "--max-shard-bytes", "lots")
    assert code == 2 and "lots" in err
    # an input in a bucket: build reads local files (its output may be a bucket)
    code, err = _main(module, capsys, "build", "s3://bucket/raw/in.jsonl", "-o", tmp_path / "d",
                      "--no-progress")
    assert code == 2 and "s3://bucket/raw/in.jsonl: mimo-shard build reads its inputs from " \
        "local files" in err, err
    # sizes in bytes or KB/MB/GB as powers of 1024, a fraction too
    from mimo_data.shards.cli import _byte_size
    assert [_byte_size(t) for t in ("500000", "512MB", "1.5GB", "0.5 KiB", "2g")] == [
        500000, 512 * 2**20, 3 * 2**29, 512, 2 * 2**30]
    # and said in the same units (info, cache, a full disk, mimo-inspect checkpoint), named so
    from mimo_data.stats import size_text
    assert [size_text(_byte_size(t)) for t in ("1000", "1.5GB", "512MB", "0.5 KiB")] == [
        "1,000 bytes", "1.5 GiB", "512.0 MiB", "512 bytes"]
    assert size_text(2**20 - 1) == "1.0 MiB"          # rounded up into the next unit


def test_shard_failed_data_and_checks_exit_1(capsys, tmp_path, good_records):
    module = CLIS["mimo-shard"]
    bad = [*good_records, {"id": "bad", "image": str(tmp_path / "gone.jpg"),
                           "conversations": good_records[0]["conversations"]}]
    source = write_jsonl(tmp_path / "in.jsonl", bad)
    code, err = _main(module, capsys, "build", source, "-o", tmp_path / "strict", "--strict",
                      "--no-progress", "--workers", "0")
    assert code == 1 and "--strict" in err
    (tmp_path / "incomplete").mkdir()                           # an interrupted build
    code, err = _main(module, capsys, "verify", tmp_path / "incomplete", "--no-progress")
    assert code == 1 and "index.json" in err and \
        "run `mimo-shard build` (or `mimo-shard index`) again" in err
    # a dataset's own file lost: exit 1, no traceback; info refuses it in one line, verify
    # lists it among the problems (what info points to)
    lost = tmp_path / "lost"
    code, _ = _main(module, capsys, "build", source, "-o", lost, "--no-progress", "--workers",
                    "0")
    (lost / "samples.parquet").unlink()
    for command, said in (("info", "samples.parquet missing (the dataset is incomplete)"),
                          ("verify", "samples.parquet: missing, not at ")):
        code, err = _main(module, capsys, command, lost)
        assert code == 1 and said in err and "Traceback" not in err, err
    assert err.rstrip().endswith(f"FAILED, 1 problem(s) in {lost}: restore what they name from "
                                 "a copy of the dataset, or rebuild the dataset"), err
    (tmp_path / "tars").mkdir()                     # a WebDataset made elsewhere, not indexed
    (tmp_path / "tars" / "part-000000.tar").write_bytes(bytes(1024))
    code, err = _main(module, capsys, "info", tmp_path / "tars")
    assert code == 1 and f"`mimo-shard index {tmp_path / 'tars'} --output DIR`" in err, err


@pytest.fixture(scope="module")
def text_dataset(tmp_path_factory):
    """Three text-only chats, built in-process (no media: cheap)."""
    root = tmp_path_factory.mktemp("cli-contract")
    records = [{"id": f"t{i}", "conversations": [{"from": "human", "value": f"Question {i}?"},
                                                 {"from": "gpt", "value": f"Answer {i}."}]}
               for i in range(3)]
    build_dataset([write_jsonl(root / "text.jsonl", records)], root / "shards")
    return root / "shards"


def _config(path, **changes):
    data = yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())
    data["tokenizer"] = str(REPO / "assets" / "tokenizer" / "smollm2")
    data.update(changes)
    path.write_text(yaml.safe_dump(data))
    return path


def test_hub_names_are_read_from_the_local_cache_without_a_request(capsys, monkeypatch,
                                                                   tmp_path, text_dataset):
    """A hub cache laid out as huggingface_hub writes it (``models--ORG--NAME/snapshots/
    COMMIT``, ``refs/main``) holding Qwen2-VL-2B's published files and SmolLM2's tokenizer:
    ``mimo-train --preprocessing-for`` and ``mimo-inspect`` take their hub names with no
    network lookup (offline, each lookup waits on retries: minutes a command); a name the
    cache lacks is one line saying to download it (exit 2)."""
    import shutil
    import socket

    from huggingface_hub import constants
    commit = "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "hub"
    for name, source in (("Qwen/Qwen2-VL-2B-Instruct",
                          MODELS / "published" / "Qwen--Qwen2-VL-2B-Instruct"),
                         ("HuggingFaceTB/SmolLM2-135M-Instruct", REPO / "assets" / "tokenizer"
                          / "smollm2")):
        repo = cache / f"models--{name.replace('/', '--')}"
        shutil.copytree(source, repo / "snapshots" / commit)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    shutil.copy(MODELS / "smollm2-135m-instruct" / "config.json",
                cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / commit)
    lookups: list = []

    def looked_up(host, *args, **kwargs):
        lookups.append(host)
        raise OSError(f"no network here ({host})")
    monkeypatch.setattr(socket, "getaddrinfo", looked_up)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)   # as a new process has it
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")})
    from mimo_train.cli import main
    from mimo_train.families.registry import preprocessing_for
    capsys.readouterr()
    assert main(["--preprocessing-for", "Qwen/Qwen2-VL-2B-Instruct"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and lookups == []
    # the video budget transformers keeps, and the cap that bounds it, said above the YAML
    assert "\n# video: each frame keeps up to max_pixels, as transformers' processor has it" \
        in out and "cap_pixels_per_frame: true holds a clip to max_video_tokens" in out, out
    # the layout the clips need (the image module serves them: refused at start-up without)
    assert "the layout gives video to its module (e.g. 'image=dp1,video;language=dp1')" in out
    expected = preprocessing_for(str(MODELS / "published" / "Qwen--Qwen2-VL-2B-Instruct"))
    assert yaml.safe_load(out) == {**expected, "tokenizer": "Qwen/Qwen2-VL-2B-Instruct",
                                   "seq_length": 1024}
    # a quoted '~/…' (the shell left the tilde) is the home folder's, as the YAML has it
    os.environ["HOME"] = str(MODELS / "published")
    assert main(["--preprocessing-for", "~/Qwen--Qwen2-VL-2B-Instruct"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["tokenizer"] == str(
        MODELS / "published" / "Qwen--Qwen2-VL-2B-Instruct")
    # its config.json given: its folder, as mimo-inspect plan --model takes it
    assert main(["--preprocessing-for", "~/Qwen--Qwen2-VL-2B-Instruct/config.json"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == {**expected, "tokenizer": str(
        MODELS / "published" / "Qwen--Qwen2-VL-2B-Instruct"), "seq_length": 1024}
    # the layout advisor takes the hub name as --model (one clip's workload: no dataset)
    qwen_preprocess = tmp_path / "qwen2_vl.yaml"
    qwen_preprocess.write_text(out)
    code, err = _main("mimo_train.inspect_cli", capsys, "plan", "--config", qwen_preprocess,
                      "--clip-seconds", 4, "--model", "Qwen/Qwen2-VL-2B-Instruct", "--gpus", 2)
    assert (code, err, lookups) == (0, "", [])
    code, err = _main("mimo_train.inspect_cli", capsys, "plan", "--config", qwen_preprocess,
                      "--clip-seconds", 4, "--model", "Qwen/Qwen2-VL-7B-Instruct", "--gpus", 2)
    assert code == 2 and lookups == [] and err.startswith(
        "mimo-inspect plan: error: --model Qwen/Qwen2-VL-7B-Instruct: the hub name "
        "'Qwen/Qwen2-VL-7B-Instruct' is not in the local hub cache"), err
    # Qwen3-VL's processor bounds the whole sampled clip's pixels, not each frame's
    assert main(["--preprocessing-for", str(MODELS / "published" /
                                            "Qwen--Qwen3-VL-2B-Instruct")]) == 0
    out = capsys.readouterr().out
    assert "\n# video: max_pixels bounds the pixels of the whole sampled clip, as " \
        "transformers' Qwen3-VL processor has it (a 1080p minute at 2 fps is ~11k tokens)" in \
        out and "each frame keeps up to max_pixels" not in out, out
    config = _config(tmp_path / "hub.yaml", tokenizer="HuggingFaceTB/SmolLM2-135M-Instruct")
    code, err = _main("mimo_data.inspect.cli", capsys, "sample", text_dataset, "--config",
                      config, "--index", "0")
    assert (code, err, lookups) == (0, "", [])
    code, err = _main("mimo_train.cli", capsys, "--preprocessing-for",
                      "Qwen/Qwen2-VL-7B-Instruct")
    assert code == 2 and lookups == []
    # an override beside it would change nothing it prints: refused, not silently unused
    code, usage = _main("mimo_train.cli", capsys, "--preprocessing-for",
                        "Qwen/Qwen2-VL-2B-Instruct", "seq_length=4096")
    assert code == 2 and "--preprocessing-for prints the model's preprocessing config and " \
        "takes nothing else (seq_length=4096 given)" in usage, usage
    assert err == ("mimo-train: --preprocessing-for: the hub name 'Qwen/Qwen2-VL-7B-Instruct' "
                   f"is not in the local hub cache ({cache}): mimo reads the cache only. "
                   "Download it first (hf download Qwen/Qwen2-VL-7B-Instruct) with "
                   "HF_HUB_CACHE or HF_HOME naming the cache this machine reads, or give its "
                   f"directory (no folder {os.path.abspath('Qwen/Qwen2-VL-7B-Instruct')} "
                   "exists, if a path was meant)\n")


@pytest.mark.parametrize("changes, named", [({"mode": "poem"}, "mode"),
                                            ({"seq_len": 8}, "seq_len"),
                                            ({"tokenizer": "./no/such/dir"}, "tokenizer:")])
def test_inspect_bad_config_exits_2(capsys, tmp_path, text_dataset, changes, named):
    config = _config(tmp_path / "bad.yaml", **changes)
    code, err = _main(CLIS["mimo-inspect"], capsys, "report", text_dataset, "--config", config,
                      "--no-progress")
    assert code == 2 and named in err


def test_inspect_output_paths_are_checked_before_the_pass(capsys, tmp_path, text_dataset,
                                                          monkeypatch):
    """--json / --html in a folder that does not exist: exit 2 before any sample is read."""
    from mimo_data.inspect import report
    config = _config(tmp_path / "good.yaml")

    def no_pass(*args, **kwargs):
        raise AssertionError("the report ran before its output was checked")
    monkeypatch.setattr(report, "build_report", no_pass)
    for flag in ("--json", "--html"):
        code, err = _main(CLIS["mimo-inspect"], capsys, "report", text_dataset, "--config",
                          config, "--no-progress", flag, tmp_path / "nowhere" / "out")
        assert code == 2 and f"{flag} {tmp_path / 'nowhere' / 'out'}: its folder " in err, err


def test_inspect_failed_check_exits_1(capsys, tmp_path, text_dataset):
    config = _config(tmp_path / "good.yaml")
    module = CLIS["mimo-inspect"]
    code, err = _main(module, capsys, "report", text_dataset, "--config", config,
                      "--no-progress")
    assert code == 0, err
    code, err = _main(module, capsys, "report", text_dataset, "--config", config,
                      "--no-progress", "--min-trained-token-fraction", "0.99")
    assert code == 1 and "FAIL trained_token_fraction" in err


@pytest.mark.parametrize("module, argv, paths", [
    ("mimo_data.shards.cli", ["build", "~/a.json", "--output=~/out", "--media-root=~/m"],
     {"inputs": ["~/a.json"], "output": "~/out", "media_root": "~/m"}),
    ("mimo_data.shards.cli", ["index", "~/tars", "--output=~/idx"],
     {"sources": ["~/tars"], "output": "~/idx"}),
    ("mimo_data.shards.cli", ["cache", "~/d", "--cache-dir=~/c"],
     {"directory": "~/d", "cache_dir": "~/c"}),
    ("mimo_data.inspect.cli", ["report", "~/d", "--config=~/p.yaml", "--cache-dir=~/c",
                               "--json=~/r.json", "--html=~/r.html"],
     {"directory": "~/d", "config": "~/p.yaml", "cache_dir": "~/c", "json": "~/r.json",
      "html": "~/r.html"}),
    ("mimo_data.inspect.cli", ["plan", "~/d", "--config=~/p.yaml", "--model=~/vlm",
                               "--layout=~/layout.yaml"],
     {"model": "~/vlm", "layout": "~/layout.yaml"}),
    ("mimo_train.cli", ["--config=~/t.yaml", "--records=~/r.jsonl"],
     {"config": "~/t.yaml", "records": "~/r.jsonl"}),
    ("mimo_train.cli", ["--preprocessing-for=~/vlm"], {"preprocessing_for": "~/vlm"}),
    ("mimo_train.hf.export", ["--checkpoint=~/ckpt", "--output=~/out", "--base=~/vlm"],
     {"checkpoint": "~/ckpt", "output": "~/out", "base": "~/vlm"}),
    ("mimo_train.hf.generate", ["--model=~/out", "--prompt=~/x", "--image=~/a.jpg",
                                "--video=~/v.mp4", "--audio=~/s.wav", "--base=~/vlm"],
     {"model": "~/out", "image": ["~/a.jpg"], "video": ["~/v.mp4"], "audio": ["~/s.wav"],
      "base": "~/vlm", "prompt": "~/x"}),
], ids=["build", "index", "cache", "report", "plan", "train", "preprocessing-for", "export",
        "generate"])
def test_paths_given_with_a_tilde_are_the_home_folders(module, argv, paths):
    """The shell leaves ``--output=~/x`` (and a quoted '~/x') as written: every path option
    reads it as the home folder's, as the YAML configs do; text (the prompt) stays as typed."""
    import importlib
    args = vars(importlib.import_module(module)._parser().parse_args(argv))
    home = {key: [os.path.expanduser(v) for v in value] if isinstance(value, list) else
            value if key == "prompt" else os.path.expanduser(value)
            for key, value in paths.items()}
    assert {key: args[key] for key in paths} == home
    assert all("~" not in str(value) for key, value in home.items() if key != "prompt")


@contextlib.contextmanager
def _closed_pipe() -> Iterator[TextIO]:
    """A pipe's writing end whose reader has gone (``| head -1`` done reading), line-buffered:
    the first line fails, as a long output's does."""
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w", buffering=1) as stdout:
        yield stdout


@pytest.mark.parametrize("module, args", [
    ("mimo_data.shards.cli", ["info", "{dataset}"]),
    ("mimo_data.inspect.cli", ["report", "{dataset}", "--config", "{config}", "--no-progress"]),
    ("mimo_train.cli", ["--preprocessing-for", MODELS / "tiny-qwen2-vl"]),
], ids=["mimo-shard", "mimo-inspect", "mimo-train"])
def test_a_closed_stdout_ends_the_cli_quietly(capsys, monkeypatch, tmp_path, text_dataset,
                                              module, args):
    """Exit 1 and nothing on stderr; in a whole process, the interpreter's last flush too."""
    config = _config(tmp_path / "good.yaml")
    args = [str(a).format(dataset=text_dataset, config=config) for a in args]
    with _closed_pipe() as stdout, monkeypatch.context() as patch:
        patch.setattr(sys, "stdout", stdout)
        assert _main(module, capsys, *args) == (1, "")
    if module == "mimo_data.shards.cli":
        with _closed_pipe() as stdout:
            done = subprocess.run([sys.executable, "-m", module, *args], stdout=stdout,
                                  stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120)
        assert (done.returncode, done.stderr) == (1, "")


def test_a_broken_pipe_elsewhere_still_raises(monkeypatch):
    """Standard output a pipe still read: a worker's broken pipe is no reader gone."""
    from mimo_data.stdout import quiet_when_stdout_closes

    @quiet_when_stdout_closes
    def main() -> int:
        print("written")
        raise BrokenPipeError("a worker's pipe")
    read, write = os.pipe()
    with os.fdopen(read) as reader, os.fdopen(write, "w") as stdout, \
            monkeypatch.context() as patch:
        patch.setattr(sys, "stdout", stdout)
        with pytest.raises(BrokenPipeError, match="worker"):
            main()
        stdout.close()
        assert reader.read() == "written\n"


def test_gpu_kernel_advice_is_kept_off_a_cpu_console():
    """transformers' advice to install fla and causal-conv1d, logged once per kernel when
    mimo-generate runs a Qwen3.5 export, is dropped where no CUDA device runs (they are GPU
    kernels) and kept where one does; its logger's other records pass."""
    import logging

    import torch
    from transformers.utils import logging as transformers_logging

    from mimo_train.runtime import console
    console.quiet_third_party()
    logger = transformers_logging.get_logger("transformers.integrations.hub_kernels")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append                 # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        logger.warning("`causal_conv1d_fn` is falling back to its reference PyTorch "
                       "implementation because `causal_conv1d` is not installed. This is "
                       "correct but much slower; install `causal_conv1d` for the optimized "
                       "kernel.")
        logger.warning("another notice")
    finally:
        logger.removeHandler(handler)
    shown = [record.getMessage()[:20] for record in records]
    assert shown == (["`causal_conv1d_fn` i", "another notice"] if torch.cuda.is_available()
                     else ["another notice"]), shown


class _Interrupted(__import__("types").ModuleType):
    """A module whose every name's import is a Ctrl-C (one pressed while it loads)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise KeyboardInterrupt


@pytest.mark.parametrize("module, args, patch", [
    ("mimo_data.inspect.cli", ["report", "{dataset}", "--config", "{config}", "--no-progress"],
     ("module", "mimo_data.shards.index")),
    ("mimo_data.inspect.cli", ["sample", "{dataset}", "--config", "{config}", "--index", "0"],
     ("module", "mimo_data.preprocess.config")),
    ("mimo_train.hf.generate", ["--model", "{dataset}", "--prompt", "hi"],
     ("quiet", "mimo_train.hf.generate")),
    ("mimo_train.cli", ["--preprocessing-for", MODELS / "tiny-qwen2-vl"],
     ("quiet", "mimo_train.cli")),
], ids=["inspect-report", "inspect-sample", "generate", "train"])
def test_a_ctrl_c_while_the_command_imports_is_one_line(capsys, monkeypatch, tmp_path,
                                                        text_dataset, module, args, patch):
    """Ctrl-C in the first second (torch, av, PIL loading) is 130 and one line, as later."""
    config = _config(tmp_path / "good.yaml")
    args = [str(a).format(dataset=text_dataset, config=config) for a in args]
    kind, target = patch
    if kind == "module":
        monkeypatch.setitem(sys.modules, target, _Interrupted(target))
    else:
        def interrupted():
            raise KeyboardInterrupt
        console = __import__(target, fromlist=["console"]).console
        monkeypatch.setattr(console, "quiet_third_party", interrupted)
    try:
        code, err = _main(module, capsys, *args)
    except KeyboardInterrupt:                   # not pytest's own Ctrl-C: the CLI let it out
        pytest.fail("the KeyboardInterrupt left main: a traceback, not one line")
    assert code == 130 and len(err.splitlines()) == 1 and "interrupted" in err, (code, err)


def test_a_training_config_that_is_no_text_is_a_usage_error(capsys):
    """A binary file given as --config: exit 2, one line, no UnicodeDecodeError traceback."""
    weights = MODELS / "tiny-qwen2-vl" / "model.safetensors"
    code, err = _main("mimo_train.cli", capsys, "--config", weights)
    assert code == 2 and len(err.splitlines()) == 1 and str(weights) in err, err
