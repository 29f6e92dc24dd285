"""Training runs for real: ``python -m mimo_train`` on 3 ranks with gloo on the sample corpus,
images + audio + language in a non-colocated layout (one rank per module); forked ranks
(tests/support/launch.py) but where torchrun's own behaviour is the point (signals, what a user
sees of a failure).

- the loss goes down; evaluation runs every N steps on a validation set, the same batches each
  time; TensorBoard gets the logged scalars; checkpoints land at the interval and at the end,
  with a manifest of each file's SHA-256; saved asynchronously, the same checkpoints;
- resume: a run stopped at a mid-run checkpoint (``train.exit_interval``) and started again
  gives exactly the losses of the uninterrupted run for the following steps; started under
  language dp2 or tp2 instead, the same losses within 1e-5 (distributed checkpoints reshard),
  also with the memory settings changed (distributed optimizer, recomputation, sequence
  parallelism, overlapped reduction) and then back to the plain run under the first layout;
  reading the dataset from S3 through injected faults instead, exactly the same losses;
  resumed with a longer ``train.steps`` and another language LR, the schedule follows the
  config (rank 0 says what changed) and keeps the step count;
- ``model.init_from`` of a tp1 or a tp2 checkpoint into language tp2 gives the first-step loss
  of tp1 into tp1 (one colocated process);
- a damaged checkpoint (zero-length, truncated or missing file, bad metadata) is refused on
  every rank with one message naming the file and the newest earlier checkpoint;
  ``mimo-inspect checkpoint`` says the same without starting a run;
- a failure in the middle of the run (a shard member whose bytes changed, shards gone from the
  bucket, a checkpoint that cannot be written, a rank killed) reaches the user as one message
  naming the rank, the step and the cause, under real torchrun as its root cause too, with no
  rank's traceback; a rank out of GPU memory (in process) says what would lower its memory;
  a save onto a full disk, asynchronous or not (in process), says the step folder;
- preemption: a signal to one worker or to torchrun stops every rank after the same step with
  that step's checkpoint, and the run started again continues the same losses.
"""

import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mimo_train.errors import RunError
from conftest import REPO, preprocess_config_file, scratch
from support.launch import BASE_ENV, TESTS, session, torchrun, torchrun_command
from support.runs import (assert_continues, copy_checkpoint, read_records, train, train_job,
                  train_records)

STEPS = 6
LAYOUT = "image=dp1;audio=dp1;language=dp1"
CONFIG = "images_audio_noncolocated.yaml"


def _train(ranks, tmp: Path, name: str, checkpoints: Path, *overrides, nproc: int = 3,
           env: dict | None = None) -> list[dict]:
    return train(ranks, tmp, name, CONFIG, f"checkpoint.dir={checkpoints}", *overrides,
                 nproc=nproc, env=env)


@pytest.fixture(scope="module")
def setup(ranks, loader_corpus, tmp_path_factory):
    with scratch(tmp_path_factory, "train-run") as tmp:
        preprocess = preprocess_config_file(tmp / "preprocess.yaml")
        common = [f"data.datasets=[{loader_corpus}]", f"data.valid=[{loader_corpus}]",
                  f"data.preprocess={preprocess}", f"layout={LAYOUT}", f"train.steps={STEPS}",
                  "train.eval_interval=3", "train.eval_steps=1", "checkpoint.interval=3",
                  "optimizer.warmup_steps=1", "train.global_batch_size=4",
                  "train.micro_batch_size=2"]
        full = _train(ranks, tmp, "full", tmp / "full-ckpt", *common,
                      f"train.tensorboard_dir={tmp / 'tb'}")
        yield tmp, common, full


def test_loss_goes_down_and_evaluation_follows(setup):
    _, _, full = setup
    train = train_records(full)
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in train]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.2, losses
    evals = [r for r in full if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]
    # the same validation batches each time
    assert evals[0]["eval_tokens"] == evals[1]["eval_tokens"] > 0
    assert all(set(r["forward_s"]) == {"image", "audio", "language"} for r in train)
    # each module's ranks' peak memory, the world's the largest (each rank its own here)
    assert all(set(r["memory_mibs"]) == {"image", "audio", "language"} and
               r["memory_mib"] == max(r["memory_mibs"].values()) for r in train)
    assert any(len(set(r["memory_mibs"].values())) == 3 for r in train), train


def test_checkpoints_at_interval_and_end(setup):
    tmp, _, _ = setup
    root = tmp / "full-ckpt"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000003", "step_0000006"]
    assert (root / "latest").read_text() == "step_0000006"
    for step in ("step_0000003", "step_0000006"):
        # megatron-core's torch_dist files, one .distcp per rank, then ours and the manifest
        assert sorted(p.name for p in (root / step).iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "integrity.json",
            "meta.json", "metadata.json"]
        meta = json.loads((root / step / "meta.json").read_text())
        assert meta["step"] == int(step[-7:]) and meta["world_size"] == 3
        manifest = json.loads((root / step / "integrity.json").read_text())
        assert sorted(manifest["files"]) == sorted(
            p.name for p in (root / step).iterdir() if p.name != "integrity.json")
        for name, digest in manifest["files"].items():
            assert digest == hashlib.sha256((root / step / name).read_bytes()).hexdigest()


def test_an_asynchronous_save_holds_the_step_it_was_started_at(ranks, setup):
    """``checkpoint.async_save``: each rank's files are written by a forked process while the
    next steps train. The losses are the synchronous run's, each checkpoint holds exactly the
    weights the synchronous run saved at that step (not a later step's: the steps after it
    changed them while it was written), its manifest is complete, and ``latest`` names the
    last one."""
    from mimo_train.components.checkpoint import load_weights

    tmp, common, full = setup
    root = tmp / "async-ckpt"
    records = _train(ranks, tmp, "async", root, *common, "checkpoint.async_save=true")
    assert [r["loss"] for r in train_records(records)] == \
        [r["loss"] for r in train_records(full)]
    assert (root / "latest").read_text() == "step_0000006"
    for step in ("step_0000003", "step_0000006"):
        assert not list((root / step).glob("integrity.*.json"))       # the parts merged
        saved, reference = load_weights(str(root / step)), load_weights(
            str(tmp / "full-ckpt" / step))
        assert saved.keys() == reference.keys()
        for module, weights in reference.items():
            assert saved[module].keys() == weights.keys()
            for key, tensor in weights.items():
                assert torch.equal(saved[module][key], tensor), (step, module, key)
    step3 = load_weights(str(root / "step_0000003"))["language"]
    step6 = load_weights(str(root / "step_0000006"))["language"]
    assert any(not torch.equal(step3[key], step6[key]) for key in step3)


def test_a_checkpoint_dir_with_checkpoints_but_no_latest_is_refused(tmp_path, monkeypatch):
    """A checkpoint copied into checkpoint.dir without its ``latest``: the run neither starts
    over beside it nor picks one; the message says how to resume from the newest. A save
    interrupted before its manifest leaves nothing to resume (said). A folder that cannot be
    written, or a transformers model folder, is refused at start-up."""
    from mimo_train.components import checkpoint
    from mimo_train.components.checkpoint import check_folder, prepare, resume_point
    from mimo_train.errors import CheckpointError

    assert resume_point(str(tmp_path)) is None
    (tmp_path / "step_0000004").mkdir()                # no manifest: an interrupted save
    assert resume_point(str(tmp_path)) is None
    said = []                                          # a run there starts over, saying so
    monkeypatch.setattr(checkpoint, "say", said.append)
    assert prepare(str(tmp_path), resume=True) is None
    checkpoint.unclaim(str(tmp_path))
    assert said == [f"mimo-train: checkpoint.dir {tmp_path} holds step_0000004 with no "
                    "integrity.json (a save that did not finish): nothing to resume, the run "
                    "starts at step 1"]
    for step in ("step_0000002", "step_0000003"):
        (tmp_path / step).mkdir()
        (tmp_path / step / "integrity.json").write_text("{}")
        (tmp_path / step / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError) as refused:
        resume_point(str(tmp_path))
    assert refused.value.exit_code == 2
    assert f"`echo step_0000003 > {tmp_path / 'latest'}`" in str(refused.value)
    (tmp_path / "latest").write_text("step_0000002")
    assert resume_point(str(tmp_path)) == str(tmp_path / "step_0000002")
    # latest naming a step no longer there: said so, with the newest earlier one
    (tmp_path / "latest").write_text("step_0000009")
    with pytest.raises(CheckpointError, match=f"latest names it, and there is no such folder "
                       rf".*the newest earlier checkpoint is {tmp_path}/step_0000003"):
        resume_point(str(tmp_path))
    (tmp_path / "latest").write_text("step_0000002")
    # a checkpoint.dir that cannot be written is refused at start-up, not at the first save
    assert prepare(str(tmp_path / "new"), resume=True) is None and (tmp_path / "new").is_dir()
    # the probe removed; the run's claim on the folder written (components/checkpoint_owner)
    assert os.listdir(tmp_path / "new") == [".mimo-run"]
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="checkpoint.dir .*file/ck cannot be written"):
        prepare(str(tmp_path / "file" / "ck"), resume=False)
    # and before the model is built (start-up's config phase), nothing made
    with pytest.raises(CheckpointError, match=f"checkpoint.dir {tmp_path}/file/ck/x cannot be "
                       rf"written here \({tmp_path}/file is a file\)"):
        check_folder(str(tmp_path / "file" / "ck" / "x"), resume=False)
    with pytest.raises(CheckpointError, match=f"checkpoint.dir {tmp_path / 'file'} is a file: "
                       "give a folder"):
        prepare(str(tmp_path / "file"), resume=False)
    # starting over (resume false) among an earlier run's steps: refused, not mixed in
    with pytest.raises(CheckpointError, match=f"checkpoint.dir {tmp_path} holds an earlier "
                       r"run's checkpoints \(step_0000002, step_0000003\) and "
                       "checkpoint.resume is false"):
        prepare(str(tmp_path), resume=False)
    # a transformers model folder given as checkpoint.dir (meant as model.pretrained) is not
    # written into: the message says which setting takes it
    model = tmp_path / "Qwen2-VL-2B-Instruct"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model-00001-of-00002.safetensors").write_text("")
    with pytest.raises(CheckpointError, match=f"set model.pretrained={model} and give "):
        prepare(str(model), resume=True)
    assert sorted(os.listdir(model)) == ["config.json", "model-00001-of-00002.safetensors"]
    # one step's folder (as the run's "checkpoint" line names it), and a dataset's folder:
    # refused before a step is written among what they hold
    step = tmp_path / "step_0000002"
    with pytest.raises(CheckpointError, match=(
            f"checkpoint.dir {step} is one step's checkpoint, not a run's checkpoint.dir"
            rf".*give its checkpoint.dir, {tmp_path}; .*model.init_from={step} ")):
        check_folder(str(step), resume=True)
    # ... not a run's own folder named like a step, before its first save or after (its
    # claim there), nor a folder of one's own that holds a meta.json
    named = tmp_path / "runs" / "step_0000001"
    for _ in range(2):                      # (the first run's claim left: a crash)
        assert prepare(str(named), resume=True) is None
    checkpoint.unclaim(str(named))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "meta.json").write_text("{}")
    assert prepare(str(tmp_path / "mine"), resume=True) is None
    checkpoint.unclaim(str(tmp_path / "mine"))
    renamed = tmp_path / "best"                        # a step's folder under another name
    shutil.copytree(step, renamed)
    with pytest.raises(CheckpointError, match="best is one step's checkpoint"):
        prepare(str(renamed), resume=True)
    assert sorted(os.listdir(renamed)) == ["integrity.json", "meta.json"]
    dataset = tmp_path / "shards"
    dataset.mkdir()
    (dataset / "index.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"checkpoint.dir {dataset} is a dataset .*a "
                       "folder of its own"):
        prepare(str(dataset), resume=True)
    assert os.listdir(dataset) == ["index.json"]


def test_a_failed_background_save_raises_its_writers_cause(tmp_path, monkeypatch):
    """torch's CheckpointException (from an asynchronous save's writers) is a BaseException,
    which the run's handlers leave alone: a traceback from every rank. The save raises its
    writer's cause, which they say once: an OSError as the folder being written (a full
    disk's, which names no file, with the space free) and what to do; a writer killed before
    it reported (no results, in megatron-core's words) as that rank's writer."""
    import errno
    from types import SimpleNamespace

    from torch.distributed.checkpoint.api import CheckpointException

    from mimo_train.components.checkpoint import Saver
    from mimo_train.errors import CheckpointError

    full = OSError(errno.ENOSPC, "No space left on device")
    denied = PermissionError(errno.EACCES, "Permission denied", "ck/step_0000004/__1_0.distcp")

    def failing(error):
        def finalize(blocking):
            raise error
        return SimpleNamespace(maybe_finalize_async_calls=finalize)
    saver = Saver("unused", asynchronous=False)
    saver.pending = ["ck/step_0000004"]
    saver.queue = failing(CheckpointException("save failed", {1: (denied, None)}))
    with pytest.raises(CheckpointError, match="^writing ck/step_0000004: Permission denied "
                       r"\(ck/step_0000004/__1_0.distcp\): this checkpoint is incomplete"):
        saver.poll()
    saver.queue = failing(CheckpointException("save failed", {1: (full, None)}))
    saver.pending = [str(tmp_path / "step_0000004")]
    with pytest.raises(CheckpointError, match=rf"writing {tmp_path}/step_0000004: no space left "
                       r"on its file system \([\d.]+ GiB free now\): this checkpoint is "
                       "incomplete, latest not moved to it") as refused:
        saver.poll()
    assert refused.value.exit_code == 1
    # megatron-core's coordinator has another rank's writer's OSError as a RuntimeError
    # around its text (pickled: without its cause)
    saver.queue = failing(CheckpointException("write", {1: (RuntimeError(
        "Worker failure: [Errno 28] No space left on device"), None)}))
    with pytest.raises(CheckpointError, match=rf"writing {tmp_path}/step_0000004: no space "):
        saver.poll()
    worker = RuntimeError(f"Worker failure: {denied}")
    saver.queue = failing(CheckpointException("write", {1: (worker, None)}))
    with pytest.raises(CheckpointError, match=rf"^writing {tmp_path}/step_0000004: Permission "
                       "denied: 'ck/step_0000004/__1_0.distcp': this checkpoint is incomplete"):
        saver.poll()
    saver.pending = ["ck/step_0000004"]
    killed = RuntimeError("results_queue should not be empty")
    saver.queue = failing(CheckpointException("save failed", {0: (full, None), 1: (killed, None)}))
    with pytest.raises(CheckpointError, match="writing ck/step_0000004: the checkpoint writer "
                       "process of rank 1 ended without reporting its part") as refused:
        saver.poll()
    assert refused.value.exit_code == 1
    saver.queue = failing(CheckpointException("save failed", {1: (KeyboardInterrupt(), None)}))
    with pytest.raises(CheckpointError, match=r"writing ck/step_0000004 failed on another rank "
                       r"\(save failed; megatron-core tells only rank 0 which and why\)"):
        saver.wait()
    # a rank not megatron-core's coordinator (no failures given) whose own writer left no
    # results says so itself
    from mimo_train.components import checkpoint as module
    from mimo_train.mcore import filesystem_async
    import queue

    from mimo_train.mcore.async_save import _ResultsQueue
    results = _ResultsQueue()
    monkeypatch.setattr(filesystem_async, "_results_queue", results)
    monkeypatch.setattr(module.dist, "get_rank", lambda: 3)
    with pytest.raises(queue.Empty):
        results.get_nowait()                     # its writer was killed: nothing there
    saver.queue = failing(CheckpointException("write", {}))
    with pytest.raises(CheckpointError, match="the checkpoint writer process of rank 3 ended "
                       "without reporting its part"):
        saver.wait()


@pytest.mark.parametrize("asynchronous, full", [
    (True, ("data", "digests")), (True, ("data",)), (False, ("data",)), (True, ("digests",)),
    (True, ("metadata",)), (True, ("thread",)), (True, ("file",)), (False, ("file",)),
    (True, ("data", "read-only")), (False, ("metadata", "read-only")), (True, ("folder",))],
    ids=["async", "async-data-only", "sync-data-only", "async-digests-only",
         "async-metadata-only", "async-write-thread", "async-torch-writer", "sync-torch-writer",
         "async-read-only", "sync-read-only-metadata", "read-only-folder"])
def test_a_save_onto_a_full_disk_says_the_step_folder(tmp_path, monkeypatch, capfd, caplog,
                                                      asynchronous, full):
    """A save onto a full file system, its file writes failing with ENOSPC where they are made:
    the checkpoint's data in megatron-core's write thread (which logs the OSError and hands on
    a RuntimeError naming only ``<class 'OSError'>``), the writer's digests after it (an
    exception escaping a forked writer is printed as its traceback), megatron-core's
    metadata.json at finalization (rank 0). The user is told the step folder, the space free
    and what to do, and sees no traceback nor megatron-core's log lines; another file system's
    error (read-only: the data, the metadata, the step folder itself) likewise, with the
    folder and what it left. In process: a
    one-rank gloo world, a one-tensor state, megatron-core's request run by a forked writer
    (``checkpoint.async_save``) or in place."""
    import errno

    from megatron.core.dist_checkpointing import serialization

    from mimo_train.components import checkpoint as module
    from mimo_train.components import digests
    from mimo_train.errors import CheckpointError
    from mimo_train.mcore import ShardedTensor, filesystem_async
    from mimo_train.runtime import distributed

    def no_space(*args, **kwargs):
        if "read-only" in full:
            raise OSError(errno.EROFS, "Read-only file system")
        raise OSError(errno.ENOSPC, "No space left on device")
    if "folder" in full:        # the step folder not made (rank 0, before the collective)
        made = os.makedirs

        def not_made(path, *args, **kwargs):
            if os.path.basename(path) == "step_0000004":
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return made(path, *args, **kwargs)
        monkeypatch.setattr(module.os, "makedirs", not_made)
    for name, (owner, function) in {"data": (filesystem_async, "_write_item"),
                                    "digests": (digests, "write_atomic"),
                                    "metadata": (serialization, "save_config")}.items():
        if name in full:                            # inherited by a forked writer
            monkeypatch.setattr(owner, function, no_space)
    if "thread" in full:
        # two write buckets: megatron-core writes the first in a thread of its own (started
        # once its main worker wrote the last), whose failure alone is the disk's
        import functools
        import threading
        import time

        from megatron.core.dist_checkpointing.strategies.torch import (
            TorchDistSaveShardedStrategy)
        written = filesystem_async._write_item

        @functools.wraps(written)           # its signature, which megatron-core reads
        def in_a_thread(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                no_space()
            return written(*args, **kwargs)
        monkeypatch.setattr(filesystem_async, "_write_item", in_a_thread)
        # the thread's last act after it said it was done, slowed: megatron-core's main thread
        # fails on its assert meanwhile, so the thread's exception must be noted before
        measured = filesystem_async._process_memory
        monkeypatch.setattr(filesystem_async, "_process_memory", lambda: (
            time.sleep(0.3) if threading.current_thread() is not threading.main_thread()
            else None) or measured())
        monkeypatch.setattr(module, "get_default_save_sharded_strategy", lambda: (
            TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=2)))
    if "file" in full:
        # a file that fills up after 300 bytes: torch.save, writing into it, says that as a
        # RuntimeError of its own ("unexpected pos"), not the OSError; that error raised where
        # megatron-core's writer calls torch.save (made there, over a file object of the test,
        # torch's failed writer crashed this process's garbage collector afterwards)
        import io

        class Full(io.BytesIO):
            def write(self, data) -> int:
                if self.tell() + len(data) > 300:
                    no_space()
                return super().write(data)
        try:
            torch.save(torch.ones(1000), Full())
        except RuntimeError as error:
            short = str(error)

        def short_write(*args, **kwargs):
            raise RuntimeError(short)
        monkeypatch.setattr(filesystem_async, "_write_item", short_write)
    monkeypatch.setattr(module, "_sharded", lambda state, step, is_loading, rng: {
        name: ShardedTensor.from_rank_offsets(name, torch.ones(64)) for name in ("w", "v")})
    monkeypatch.setattr(filesystem_async, "_results_queue", None)      # this test's own
    step = tmp_path / "step_0000004"
    said = (r"torch's file writer wrote less than it was given \(.*unexpected pos.*\), as on a "
            r"full file system or past a quota" if "file" in full else
            "no space left on its file system")
    said = rf"{said} \([\d.]+ GiB free now\)" if "read-only" not in full else \
        r"Read-only file system( \(.*\))?"
    said = rf"^writing {step}: {said}: this checkpoint is incomplete, latest not moved to it"
    if "folder" in full:
        said = rf"^checkpoint {step} cannot be made \(Permission denied; rank 0 makes it\): " \
            "nothing of it is written, latest not moved"
    with distributed.alone(), pytest.raises(CheckpointError, match=said) as refused:
        saver = module.Saver(str(tmp_path), asynchronous)
        saver.save(4, None, {"step": 4})
        saver.wait()
    assert refused.value.exit_code == 1 and not (tmp_path / "latest").exists()
    printed = capfd.readouterr()
    for word in ("Traceback", "ForkProcess", "Worker failure", "Local worker", "OSError"):
        assert word not in printed.out + printed.err, printed
    # megatron-core's log lines of the failure (in place; a forked writer's are its own)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_tensorboard_gets_the_scalars(setup):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _, full = setup
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    logged = [e.value for e in events.Scalars("train/loss")]
    assert logged == pytest.approx([r["loss"] for r in train_records(full)], rel=1e-6)
    assert [e.step for e in events.Scalars("eval_loss")] == [3, 6]
    assert {"forward_s/image", "forward_s/audio", "forward_s/language", "train/lr",
            "train/grad_norm", "train/tokens_per_s"} <= set(events.Tags()["scalars"])


def test_records_and_step_lines_carry_the_model_flops(setup):
    """Each step's record: its model FLOPs per module (the global batch's, checked in
    ``test_train_parity.py``), TFLOP/s per rank of the world, no MFU on a CPU without
    ``train.peak_tflops``; the step lines show the TFLOP/s, TensorBoard gets them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _, full = setup
    for record in train_records(full):
        assert set(record["flops"]) == {"image", "audio", "language"}
        assert min(record["flops"].values()) > 0
        assert record["tflops_per_gpu"] == pytest.approx(
            sum(record["flops"].values()) / record["seconds"] / 3 / 1e12)
        assert record["mfu"] is None
    lines = [line for line in (tmp / "full-logs" / "rank_0.out").read_text().splitlines()
             if line.startswith("step ")]
    assert len(lines) == STEPS and all(" TFLOP/s " in line and "MFU" not in line
                                       for line in lines)
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    assert {"train/tflops_per_gpu", "flops/language", "flops/image"} <= set(
        events.Tags()["scalars"])


def test_resume_continues_the_exact_sample_stream(ranks, setup):
    """The step-3 checkpoint resumed under the same layout: steps 4-6 and the evaluation at 6
    are exactly the uninterrupted run's. As after a crash past step 3, the records file and
    TensorBoard already hold steps 1-6 (the full run's): steps 4-6 are in each once, the
    file's with a note; ``checkpoint.keep_last=1`` deletes step 3 once step 6 is saved."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, common, full = setup
    # the run's totals, each step's added up (a resume's go on from its checkpoint's)
    steps = train_records(full)
    assert [(r["consumed_samples"], r["consumed_tokens"], r["consumed_sequence_tokens"])
            for r in steps] == [
        (4 * r["step"], sum(s["tokens"] for s in steps[:i + 1]),
         sum(s["sequence_tokens"] for s in steps[:i + 1])) for i, r in enumerate(steps)]
    root = copy_checkpoint(tmp / "full-ckpt" / "step_0000003", tmp / "resume")
    shutil.copy(tmp / "full.jsonl", tmp / "crashed.jsonl")
    shutil.copytree(tmp / "tb", tmp / "tb-resumed")
    _train(ranks, tmp, "resumed", root, *common, "checkpoint.keep_last=1",
           f"train.tensorboard_dir={tmp / 'tb-resumed'}", "--records", tmp / "crashed.jsonl")
    records = read_records(tmp / "crashed.jsonl")
    (note,) = [i for i, r in enumerate(records) if "note" in r]
    before, resumed = records[:note], records[note + 1:]
    assert before == [r for r in full if r["step"] <= 3]
    assert records[note] == {"step": 3, "note": "records of steps 4-6 dropped: the run resumed "
                             "from the checkpoint of step 3 and trains the steps after it again"}
    assert_continues(resumed, full, [4, 5, 6], loss=1e-6, grad_norm_rel=1e-6)
    eval_resumed = [r["eval_loss"] for r in resumed if "eval_loss" in r]
    assert eval_resumed == pytest.approx([r["eval_loss"] for r in full if "eval_loss" in r
                                          and r["step"] == 6], abs=1e-6)
    events = EventAccumulator(str(tmp / "tb-resumed"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert [e.step for e in events.Scalars("eval_loss")] == [3, 6]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000006"]
    assert (root / "latest").read_text() == "step_0000006"


def _cosine(step: int, lr: float, min_lr: float, steps: int, warmup: int = 1) -> float:
    """Linear warmup from 0 over ``warmup`` steps, then cosine from ``lr`` to ``min_lr`` at
    ``steps``: the LR set after ``step`` steps."""
    if step <= warmup:
        return lr * step / warmup
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup) /
                                                        (steps - warmup)))


def _param_groups(node) -> list[dict]:
    """Every optimizer param group nested in a loaded checkpoint."""
    if isinstance(node, dict):
        return [group for key, value in node.items() for group in (
            value if key == "param_groups" and isinstance(value, list) else
            _param_groups(value))]
    if isinstance(node, (list, tuple)):
        return [group for value in node for group in _param_groups(value)]
    return []


def test_a_resumed_run_follows_the_configured_schedule(ranks, setup):
    """The last checkpoint (step 6 of a 6-step schedule, its LR at the minimum) resumed with
    train.steps 12 and the language model's lr a third (its min_lr scaled with it): rank 0
    (which holds the image module alone) says each change at start-up, and the LR after the
    resumed step is the cosine schedule of the new length, with each module's own rates; the
    full run's LRs follow the same formula over its 6 steps. Its ``train.exit_duration_minutes``
    has passed by its first step (a microsecond): it stops after step 7 with a checkpoint,
    exit status 0."""
    tmp, common, full = setup
    for record in train_records(full):
        for module in ("image", "audio", "language"):
            assert record["lrs"][module] == pytest.approx(
                _cosine(record["step"], 3e-3, 3e-4, STEPS), rel=1e-9), record
    root = copy_checkpoint(tmp / "full-ckpt" / f"step_{STEPS:07d}", tmp / "longer")
    job = train_job(ranks, tmp, "longer", CONFIG, f"checkpoint.dir={root}",
                    *[c for c in common if not c.startswith("train.steps=")], "train.steps=12",
                    "train.exit_duration_minutes=1e-8",
                    "optimizer.modules={language: {lr: 1.0e-3}}", "optimizer.adam_beta2=0.99",
                    nproc=3).check()
    assert "mimo-train: train.exit_duration_minutes 1e-08 passed: stopping after step 7\n" in \
        job.stdout, job.stdout
    assert (root / "latest").read_text() == "step_0000007"
    for line in ("resumed from step 6 of a schedule of 6 steps: LR decay now spans train.steps 12 "
                 "(was 6)", "resumed from step 6: language lr now 0.001 (was 0.003)",
                 "resumed from step 6: language min_lr now 0.0001 (was 0.0003)",
                 "resumed from step 6: image, audio, language adam_beta2 now 0.99 (was 0.95)"):
        assert f"mimo-train: {line}\n" in job.stdout, job.stdout
    assert job.stdout.count("mimo-train: resumed from step 6") == 4, job.stdout
    # the betas the resumed steps took, as step 7's checkpoint holds them (torch's
    # load_state_dict would have put the checkpoint's back over the config's)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(root / "step_0000007", tmp / "longer-step7.pt")
    saved = torch.load(tmp / "longer-step7.pt", weights_only=False)
    betas = {tuple(group["betas"]) for group in _param_groups(saved)}
    assert betas == {(0.9, 0.99)}, betas
    assert "the checkpoint was saved under layout" not in job.stdout      # its own layout
    assert "mimo-train: trains: every module in full\n" in job.stdout, job.stdout
    # what the run will do, said before its first step
    assert (f"mimo-train: steps 7 to 12 of global batch 4, precision fp32, lr 0.003 (warmup 1, "
            f"cosine to 0.0003; language their own); checkpoints to {root} every 3 steps and "
            "at the last\n") in job.stdout, job.stdout
    (record,) = train_records(read_records(tmp / "longer.jsonl"))
    assert record["step"] == 7
    language_lr = 1e-3, 3e-4 * 1e-3 / 3e-3
    expected = {"image": _cosine(7, 3e-3, 3e-4, 12), "audio": _cosine(7, 3e-3, 3e-4, 12),
                "language": _cosine(7, *language_lr, 12)}
    assert record["lrs"] == pytest.approx(expected, rel=1e-9)
    assert min(record["lrs"].values()) > 3e-4     # the checkpoint's schedule: its min_lr


@pytest.mark.parametrize("steps", [12, 10])
def test_a_checkpoint_at_or_past_train_steps_says_nothing_is_left(monkeypatch, capsys, steps):
    """Resuming the checkpoint of step 12 with train.steps 12 or 10 (in process: the
    trainer's resume and loop with the checkpoint's load and the model stubbed): one line
    says nothing is left to train, no schedule note says the LR decay changed, and the run's
    claim on the folder is released (the next run of another host would wait for it)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from mimo_train.components.anomalies import Watch
    from mimo_train.training import trainer as module

    monkeypatch.setattr(module, "phase", lambda name, done, function, start=None: function())
    monkeypatch.setattr(module, "distributed", SimpleNamespace(gather=lambda value: [value]))
    monkeypatch.setattr(module, "checkpoint_fit", SimpleNamespace(
        check=lambda *args: {}, check_lora_scale=lambda *args: None,
        resume_notes=lambda *args: []))
    monkeypatch.setattr(module, "checkpoint", SimpleNamespace(
        load=lambda *args: (12, {"language": {
            "train.steps": (12, steps)} if steps != 12 else {}})))
    trainer = module.Trainer.__new__(module.Trainer)
    trainer.cfg = SimpleNamespace(
        train=SimpleNamespace(steps=steps, exit_signals=[], eval_interval=0, exit_interval=0,
                              global_batch_size=4, micro_batch_size=2, precision="fp32"),
        checkpoint=SimpleNamespace(interval=0), data=SimpleNamespace(datasets=["d"]),
        model=SimpleNamespace(freeze=[], lora={}, init_from=None), to_dict=lambda: {"model": {}})
    trainer.model, trainer.training_state, trainer._meta = None, lambda: None, lambda: {}
    trainer.layout, trainer.world, trainer.micro_batches = LAYOUT, 3, 1
    trainer.device = torch.device("cpu")
    released = []
    trainer.loader, trainer.samples = None, {}
    trainer.saver = SimpleNamespace(release=lambda: released.append(True))
    trainer.watch, trainer.profile = Watch(0, 0.0, 1), nullcontext()
    trainer.metrics = SimpleNamespace(records=[], flush=lambda: [], close=lambda: None,
                                      publish=lambda: None)
    trainer._resume("ck/step_0000012")
    assert trainer._train() == []
    assert released == [True]
    output = capsys.readouterr().out
    assert f"mimo-train: the checkpoint at step 12 is at or past train.steps={steps}: " \
        "nothing to train\n" in output, output
    assert "LR decay" not in output and "layout" not in output, output


@pytest.mark.parametrize("eval_steps, per_epoch, left_out, said", [
    (8, 2, 0, "each evaluation runs 2, every validation sample once\n"),
    (8, 2, 4, "each evaluation runs 2, every validation sample once but the 4 the remainder "
              "leaves out (a global batch that divides the kept samples evaluates them all)\n"),
    (1, 4, 0, "1 step(s) of 6 samples per evaluation, the same each time (1 of the epoch's 4 "
              "batches: train.seed and the global batch size pick which)\n")])
def test_the_validation_line_says_which_samples_an_evaluation_counts(monkeypatch, capsys,
                                                                     eval_steps, per_epoch,
                                                                     left_out, said):
    """Start-up's lines on the validation set say what an evaluation counts: the whole epoch
    with the samples the remainder leaves out named, or a part of it, which the seed and the
    global batch draw. In process: the trainer's validation loader stubbed."""
    from types import SimpleNamespace

    from mimo_train.training import trainer as module
    monkeypatch.setattr(module, "distributed", SimpleNamespace(gather=lambda value: [value]))
    trainer = module.Trainer.__new__(module.Trainer)
    trainer.cfg = SimpleNamespace(train=SimpleNamespace(eval_steps=eval_steps,
                                                        global_batch_size=6))
    trainer.valid_loader = SimpleNamespace(summary=lambda: "16 samples, 16 kept",
                                           steps_per_epoch=per_epoch,
                                           order=SimpleNamespace(remainder_samples=left_out))
    assert trainer._eval_steps() == min(eval_steps, per_epoch)
    output = capsys.readouterr().out
    assert said in output, output
    assert ("every validation sample once" in output) == (eval_steps > per_epoch), output


@pytest.mark.parametrize("during", ["SIGTERM", "deadline", "exit_interval"])
def test_a_signal_a_time_limit_or_exit_interval_stops_on_its_step(monkeypatch, capsys, during):
    """An exit signal that comes while a step's checkpoint is saved, or the run's time limit
    passing then (in process: the loop with its steps, save and the ranks' agreement stubbed),
    stops the run on that checkpoint: no further step is trained and saved, which at real
    sizes would spend the grace time twice. A run without checkpoint.dir stopped by
    train.exit_interval says that nothing was saved (a rerun starts over)."""
    import signal
    from types import SimpleNamespace

    from mimo_train.runtime.preemption import PAST_DEADLINE
    from mimo_train.training import trainer as module

    saved: list[int] = []

    class Signals:                  # the ranks agree on the signal once a save has begun
        def __init__(self, names, deadline):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def agreed(self):
            if during == "exit_interval":
                return 0
            return (signal.SIGTERM if during == "SIGTERM" else PAST_DEADLINE) if saved else 0

    class Profile:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def before(self, step):
            pass

        def after(self, step):
            pass

    monkeypatch.setattr(module, "ExitSignals", Signals)
    trainer = module.Trainer.__new__(module.Trainer)
    trainer.cfg = SimpleNamespace(
        train=SimpleNamespace(steps=6, exit_signals=["SIGTERM"], eval_interval=0,
                              exit_interval=2 if during == "exit_interval" else 0,
                              micro_batch_size=2, exit_duration_minutes=5,
                              global_batch_size=2, precision="fp32"),
        checkpoint=SimpleNamespace(interval=2, dir=None if during == "exit_interval" else "ck",
                                   keep_last=None),
        optimizer=SimpleNamespace(lr=1e-3, min_lr=1e-4, warmup_steps=0, modules={}),
        data=SimpleNamespace(datasets=["d"]), warmup_steps=lambda: (0, None))
    trainer.deadline, trainer.step, trainer.stopped_by, trainer.samples = None, 0, 0, {}
    trainer.layout, trainer.world, trainer.micro_batches = LAYOUT, 3, 1
    trainer.device, trainer.loader, trainer.step_samples = torch.device("cpu"), None, []

    def train_step(iterator):
        trainer.step += 1
        return object(), [], []
    trainer.train_step, trainer.batches = train_step, lambda loader, datasets: iter(())
    trainer.save, trainer.settle = lambda: saved.append(trainer.step), lambda: ([], [])
    trainer._anomalies, trainer.profile = lambda skipped, read: None, Profile()
    trainer.saver = None if during == "exit_interval" else SimpleNamespace(
        poll=list, wait=list, release=lambda: None, queue=None)
    trainer.metrics = SimpleNamespace(records=[], flush=lambda show=False: [],
                                      close=lambda: None)
    trainer._train()
    assert saved == ([] if during == "exit_interval" else [2]) and trainer.step == 2, saved
    assert trainer.stopped_by == (signal.SIGTERM if during == "SIGTERM" else 0)
    assert {"SIGTERM": "mimo-train: SIGTERM received: stopped after step 2\n",
            "deadline": "mimo-train: train.exit_duration_minutes 5 passed: stopping after step "
                        "2\n",
            "exit_interval": "mimo-train: train.exit_interval 2: stopping at step 2 (no "
                             "checkpoint.dir: nothing saved)\n"}[during] \
        in capsys.readouterr().out


def test_a_signal_before_the_training_steps_stops_the_rank_with_its_clean_ups(monkeypatch,
                                                                              tmp_path):
    """An exit signal during start-up (a token table's write, here) raises StartupSignal:
    the table's temporary file is removed on the way out (the default action would leave it in
    the dataset's folder), a second copy of it (torchrun's) does not stop the clean-ups; the
    handlers before are back after; once the training steps have begun (``ExitSignals``
    entered), the start-up handler gives the default action. (A rank blocked in the
    rendezvous, whose handler cannot run, ends 5 s after the signal saying so: checked by hand,
    a process of its own.)"""
    import os
    import signal
    import time

    import pyarrow as pa

    from mimo_data.shards import cache
    from mimo_train.runtime import preemption

    before = signal.getsignal(signal.SIGUSR1)
    digest = cache.columns_digest

    def signalled(table):           # once the table's first temporary file is written
        os.kill(os.getpid(), signal.SIGUSR1)        # handled at the next bytecode
        return digest(table)
    monkeypatch.setattr(cache, "columns_digest", signalled)
    with pytest.raises(preemption.StartupSignal) as stopped:
        with preemption.before_training(["SIGUSR1"]):
            cache.write_table(str(tmp_path / "tokens.arrow"), pa.table({"x": [1, 2]}), "k",
                              cache.Labels("tokens", "d"))
    assert stopped.value.number == signal.SIGUSR1 and os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGUSR1) == before
    # torchrun's copy of the same delivery while the clean-ups run: they finish
    cleaned = []
    with pytest.raises(preemption.StartupSignal):
        with preemption.before_training(["SIGUSR1"]):
            try:
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(1)
            finally:
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.1)
                cleaned.append(True)
    assert cleaned == [True]
    # the ignoring ExitSignals leaves once the ranks agreed to stop stays (torchrun's SIGTERM
    # to the ranks still saving would kill them)
    with preemption.before_training(["SIGUSR1"]):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    signal.signal(signal.SIGUSR1, before)
    killed: list[int] = []
    monkeypatch.setattr(preemption.os, "kill", lambda pid, number: killed.append(number))
    with preemption.before_training(["SIGUSR1"]):
        monkeypatch.setattr(preemption, "_training", True)      # ExitSignals entered
        signal.getsignal(signal.SIGUSR1)(signal.SIGUSR1, None)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL and \
            killed == [signal.SIGUSR1]


def test_a_second_exit_signal_later_than_the_repeat_window_ends_the_rank_at_once(monkeypatch):
    """While the training steps run, an exit signal is held until the step ends; a copy of it
    within ``REPEAT_SECONDS`` of the first (Slurm's to every process, then torchrun's) is the
    same delivery, but a second one later (a user's second Ctrl-C) ends the rank at once: the
    default action put back and the signal sent again. In process: the clock and ``os.kill``
    stubbed, the installed handler called."""
    import signal
    from types import SimpleNamespace

    from mimo_train.runtime import preemption

    now, killed = [100.0], []
    monkeypatch.setattr(preemption, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(preemption.os, "kill", lambda pid, number: killed.append((pid, number)))
    monkeypatch.setattr(preemption, "_training", False)        # put back after
    before = signal.getsignal(signal.SIGUSR1)
    try:
        with preemption.ExitSignals(["SIGUSR1"]) as signals:
            handler = signal.getsignal(signal.SIGUSR1)
            assert handler == signals._handle
            handler(signal.SIGUSR1, None)
            assert signals.received == signal.SIGUSR1 and killed == []
            now[0] += preemption.REPEAT_SECONDS                 # the same delivery's copy
            handler(signal.SIGUSR1, None)
            assert killed == [] and signal.getsignal(signal.SIGUSR1) == signals._handle
            now[0] += 0.5                                       # a second signal: die now
            handler(signal.SIGUSR1, None)
            assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
            assert killed == [(os.getpid(), signal.SIGUSR1)]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_the_exit_signals_stay_ignored_once_the_ranks_agreed_to_stop(monkeypatch):
    """Leaving ``ExitSignals`` puts back the handler before it, unless the ranks agreed to stop
    on a signal: then the run's exit signals stay ignored, so torchrun's SIGTERM (sent once the
    first rank has exited) does not kill a rank still saving its stop checkpoint; until then a
    signal to the stopping rank does nothing."""
    import signal
    import time

    from mimo_train.runtime import preemption

    killed = []
    monkeypatch.setattr(preemption.os, "kill", lambda pid, number: killed.append(number))
    monkeypatch.setattr(preemption, "_training", False)        # put back after

    def previous(number, frame):
        pass
    before = signal.signal(signal.SIGUSR1, previous)
    try:
        with preemption.ExitSignals(["SIGUSR1"]):
            assert signal.getsignal(signal.SIGUSR1) != previous
        assert signal.getsignal(signal.SIGUSR1) == previous
        with preemption.ExitSignals(["SIGUSR1"]) as signals:
            # a second signal long after the first, which would end a rank that is not stopping
            signals.received, signals.stopping = signal.SIGUSR1, True
            signals._since = time.monotonic() - 2 * preemption.REPEAT_SECONDS
            signal.getsignal(signal.SIGUSR1)(signal.SIGUSR1, None)     # torchrun's SIGTERM
            assert killed == [] and signal.getsignal(signal.SIGUSR1) == signals._handle
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_the_time_limit_counts_from_the_process_start():
    """``train.exit_duration_minutes`` under ``mimo-train`` counts from the rank's process
    start (its imports and launch, as the job's limit does), not from the trainer's: the
    process's start is the one psutil reads from the system (whose boot time is whole
    seconds: within one); a trainer built in a long-lived process (a notebook) counts from
    its own start."""
    import time

    import psutil

    from mimo_train.runtime.launcher import started
    from mimo_train.runtime.preemption import deadline
    age = time.monotonic() - started()
    assert age == pytest.approx(time.time() - psutil.Process().create_time(), abs=1.05)
    assert age > 1.0                    # pytest and torch imported before (seconds)
    begun = started()
    assert deadline(2, begun) == begun + 120
    assert deadline(2) == pytest.approx(time.monotonic() + 120, abs=0.1)
    assert deadline(0, begun) is None


def test_mimo_train_stopped_by_a_signal_during_start_up(monkeypatch, tmp_path, capsys, setup):
    """``mimo-train`` (in process, one rank: the trainer's start-up stubbed as one that has
    claimed checkpoint.dir and is reading a table when SIGTERM comes) exits 143 with one line
    saying it stopped before training and nothing was saved, and releases its claim of the
    folder (a rerun from another host would otherwise wait for it to go stale). The trainer
    is given the process's start to count train.exit_duration_minutes from."""
    import signal
    import time

    from mimo_train import cli
    from mimo_train.components import checkpoint_owner
    from mimo_train.runtime.launcher import started
    from mimo_train.training import trainer as module

    _, common, _ = setup
    root = tmp_path / "checkpoints"
    given = []

    def start_up(plan, records, begun):
        given.append(begun)
        root.mkdir()
        checkpoint_owner.claim(str(root))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)                  # the handler raises at the next bytecode
        raise AssertionError("SIGTERM did not stop the start-up")
    monkeypatch.setattr(module, "train", start_up)
    before = signal.getsignal(signal.SIGTERM)
    code = cli.main(["--config", str(REPO / "configs" / "train" / CONFIG), *common,
                     f"checkpoint.dir={root}"])
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert err.count("mimo-train: SIGTERM during start-up: stopped before training, nothing "
                     "saved") == 1, err
    assert "Traceback" not in err and os.listdir(root) == [], (err, os.listdir(root))
    assert signal.getsignal(signal.SIGTERM) == before
    assert given == [pytest.approx(started(), abs=0.05)], given


def test_a_resume_checks_the_adapters_scale_before_loading(monkeypatch, tmp_path):
    """The trainer's resume and model.init_from (in process, the checkpoint's tensor checks
    and loads stubbed) run the checkpoint's LoRA alpha check: a run with alpha 64 on adapters
    trained at 8 is refused before any weight is loaded; a resume with model.init_from given
    too says the checkpoint's weights replace init_from's; one with another preprocessing than
    the checkpoint's run says each setting that changed."""
    from types import SimpleNamespace

    from mimo_train.components import checkpoint_fit
    from mimo_train.config import LoraConfig
    from mimo_train.errors import CheckpointError
    from mimo_train.training import trainer as module

    loaded = []
    monkeypatch.setattr(module, "phase", lambda name, done, function, start=None: function())
    monkeypatch.setattr(module, "checkpoint_fit", SimpleNamespace(
        check=lambda *args: {"config": {"model": {"lora": {"language": {"alpha": 8}}}}},
        check_lora_scale=checkpoint_fit.check_lora_scale,
        resume_notes=checkpoint_fit.resume_notes))
    monkeypatch.setattr(module, "checkpoint", SimpleNamespace(
        load=lambda *args: loaded.append(args) or (1, {})))
    trainer = module.Trainer.__new__(module.Trainer)
    trainer.cfg = SimpleNamespace(
        train=SimpleNamespace(global_batch_size=4, precision="fp32"),
        model=SimpleNamespace(freeze=[], lora={"language": LoraConfig(alpha=64)}),
        to_dict=lambda: {"model": {}})
    trainer.model, trainer.training_state, trainer._meta = None, lambda: None, lambda: {}
    with pytest.raises(CheckpointError, match="model.lora.language.alpha 8, this run's "
                       "model.lora.language.alpha is 64"):
        trainer._resume("ck/step_0000001")
    # a new run from its weights (model.init_from) starts from the model it trained, too
    monkeypatch.setattr(module.checkpoint_folders, "step_of", lambda given: given)
    monkeypatch.setattr(module.checkpoint, "load_model", lambda *args: loaded.append(args),
                        raising=False)
    with pytest.raises(CheckpointError, match="is 64: .* start from it with alpha 8, or, for "
                       r"new adapters with another alpha, from its merged export \(mimo-export"):
        trainer._init_from("ck/step_0000001")
    assert loaded == []
    # a resume with model.init_from given too: the checkpoint's weights win, and it says so
    said = []
    monkeypatch.setattr(module, "say", said.append)
    monkeypatch.setattr(module.distributed, "gather", lambda value: [value])
    trainer.cfg.model.lora, trainer.cfg.model.init_from = {"language": LoraConfig(alpha=8)}, "a"
    trainer.cfg.train.steps = 4
    trainer._resume("ck/step_0000001")
    assert said == ["mimo-train: model.init_from a is replaced by the checkpoint resumed from "
                    "(ck/step_0000001): its weights continue the run; to start over from "
                    "init_from, give another checkpoint.dir"]
    # another pretrained folder and more of the model frozen than the checkpoint's run had:
    # said, from the run's config as it saves it
    monkeypatch.setattr(module.checkpoint_fit, "check", lambda *args: {"config": {"model": {
        "pretrained": "/m/a", "freeze": [], "lora": {"language": {"alpha": 8}}}}})
    trainer.cfg.to_dict = lambda: {"model": {"pretrained": "/m/b", "freeze": ["image"]}}
    trainer.cfg.model.init_from, trainer.cfg.model.freeze = None, ["image"]
    said.clear()
    trainer._resume("ck/step_0000001")
    assert [line.split(": ", 2)[:2] for line in said] == [
        ["mimo-train", "resuming ck/step_0000001"]] * 2
    assert said[0].endswith("model.pretrained is /m/b here, /m/a when the checkpoint was saved: "
                            "the checkpoint's weights continue the run (the folder gives the "
                            "model's config and files, of the same shapes)"), said
    assert said[1].endswith("model.freeze now holds image, which trained until this "
                            "checkpoint: frozen from here, their optimizer state dropped (a "
                            "later resume cannot train them again: model.init_from can)"), said
    trainer.cfg.to_dict, trainer.cfg.model.freeze = lambda: {"model": {}}, []
    # the run's preprocessing (meta.json's) and this one's: smaller images, longer rows
    from mimo_data.preprocess.config import PreprocessConfig
    path = preprocess_config_file(tmp_path / "pp.yaml")
    trainer.preprocess = PreprocessConfig.from_yaml(str(path))
    saved = json.loads(json.dumps(trainer.preprocess.to_dict()))
    saved["seq_length"] *= 2
    saved["modalities"]["image"]["max_pixels"] *= 4
    monkeypatch.setattr(module.checkpoint_fit, "check", lambda *args: {"preprocess": saved})
    trainer.cfg.model.init_from, trainer.cfg.data = None, SimpleNamespace(preprocess=str(path))
    said.clear()
    trainer._resume("ck/step_0000001")
    now = trainer.preprocess
    assert said == [
        f"mimo-train: resuming ck/step_0000001 with another preprocessing than the run's so far "
        f"({path}): seq_length {now.seq_length} (was {2 * now.seq_length}); "
        f"modalities.image.max_pixels {now.modalities['image'].max_pixels} (was "
        f"{4 * now.modalities['image'].max_pixels}): the samples are made so from here on "
        "(where it keeps other samples than the run's, the loader refuses the resume)"]
    # saved by a mimo without a setting this one has: its default, no change said
    del saved["modalities"]["image"]["max_image_pixels"]
    saved["seq_length"] //= 2
    saved["modalities"]["image"]["max_pixels"] //= 4
    said.clear()
    trainer._resume("ck/step_0000001")
    assert said == [], said


def test_schedule_notes_name_each_changed_setting():
    """One line per changed setting (warmup and weight decay too), the modules with the same
    change in one line; none for what did not change."""
    from types import SimpleNamespace

    from mimo_train.components.optimizer import schedule_changes, schedule_notes
    from mimo_train.mcore import OptimizerParamScheduler

    def scheduler(lr: float, warmup: int, steps: int, weight_decay: float):
        return OptimizerParamScheduler(
            SimpleNamespace(param_groups=[{}]), init_lr=0.0, max_lr=lr, min_lr=lr / 10,
            lr_warmup_steps=warmup, lr_decay_steps=steps, lr_decay_style="cosine",
            start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=steps,
            wd_incr_style="constant")

    saved = scheduler(1e-3, 2, 20, 0.0).state_dict()
    rank0 = {"image": schedule_changes(saved, scheduler(1e-3, 2, 20, 0.0))}
    rank1 = {"audio": schedule_changes(saved, scheduler(1e-3, 4, 20, 0.1)),
             "language": schedule_changes(saved, scheduler(1e-3, 4, 20, 0.0))}
    assert rank0 == {"image": {}}
    assert schedule_notes(12, [rank0, rank1]) == [
        "resumed from step 12: audio, language warmup_steps now 4 (was 2)",
        "resumed from step 12: audio weight_decay now 0.1 (was 0)"]


def test_training_from_a_bucket_gives_the_local_losses(ranks, setup, loader_corpus, s3):
    """The dataset copied to S3 (moto behind a proxy that answers 500, resets the connection or
    cuts the body short on 5% of GETs), the local run's step-3 checkpoint resumed reading the
    bucket, with an empty cache (tables downloaded, token tables computed): steps 4-6 and the
    evaluation at 6 have the local run's tokens and losses. The shards gone from the bucket:
    the start-up's shard check stops the run there, one message naming them."""
    import fsspec

    from tools.object_store import Faults

    tmp, common, full = setup
    s3.make_bucket("train-run")
    fs = fsspec.filesystem("s3", **s3.storage_options)
    fs.put(str(loader_corpus), "train-run/shards", recursive=True)
    url = "s3://train-run/shards"
    remote = [c.replace(str(loader_corpus), url) for c in common]
    env = {**s3.env(), "MIMO_CACHE_DIR": str(tmp / "bucket-cache")}
    s3.faults = Faults(rate=0.05, kinds=("500", "reset", "truncate"), seed=3)
    root = copy_checkpoint(tmp / "full-ckpt" / "step_0000003", tmp / "bucket-resume")
    resumed = _train(ranks, tmp, "bucket-resumed", root, *remote, env=env)
    assert sum(s3.injected.values()) > 0        # the faults happened, and were survived
    # the shards gone from the bucket: found at start-up, not when first read (no hang)
    s3.faults = None
    fs.rm(fs.glob("train-run/shards/*.tar"))
    failed = train_job(ranks, tmp, "bucket-failed", CONFIG, *remote,
                       f"checkpoint.dir={tmp / 'bucket-failed-ckpt'}", nproc=3, env=env)
    assert failed.codes[0] == 1, failed.explain()
    reports = [text for text in failed.ranks.values() if "start-up failed (data)" in text]
    assert len(reports) == 1 and "Traceback" not in "".join(failed.ranks.values()), \
        failed.explain()
    assert f"DatasetError: {url}: shard data-000000.tar missing; data-000001.tar missing" \
        in reports[0], reports[0]
    assert f"mimo-shard verify {url}" in reports[0]
    assert_continues(resumed, full, [4, 5, 6], loss=1e-6, grad_norm_rel=1e-6)
    assert [r["eval_loss"] for r in resumed if "eval_loss" in r] == pytest.approx(
        [r["eval_loss"] for r in full if "eval_loss" in r and r["step"] == 6], abs=1e-6)


def _failed_run(tmp: Path, name: str, *overrides, env: dict | None = None) -> str:
    """Run the 3-rank job under real torchrun, as a user would, expecting it to fail in the
    middle of the run: exit status 1, one message naming the rank, the step and the cause
    (printed once, also as torchrun's root cause), no traceback from any rank; the message."""
    job = torchrun(3, ["-m", "mimo_train", "--config", REPO / "configs" / "train" / CONFIG,
                       f"checkpoint.dir={tmp / name}", *overrides], env=env)
    output = job.stdout + job.stderr
    print(output)
    assert job.codes == [1], job.explain()
    messages = re.findall(r"^mimo-train: training stopped in .*$", output, re.MULTILINE)
    assert len(messages) == 1, output
    assert re.match(r"mimo-train: training stopped in (step \d+|the evaluation at step \d+) "
                    r"on rank \d \(", messages[0]), messages[0]
    assert "[rank" not in output and output.count("Traceback") <= 1, output  # torchrun's own
    assert "error_file:" in output and messages[0] in output.split("Root Cause")[-1], output
    return messages[0]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:                 # ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_a_damaged_member_mid_run_is_one_message_naming_rank_step_and_member(setup,
                                                                            loader_corpus):
    """Every image member of a copy of the shards changed after the build (bytes zeroed
    inside, the recorded crc32 kept): the image rank stops the run in its first step with
    images, and the user sees one message naming that rank, the step, the member and
    ``mimo-shard verify`` (as torchrun's root cause too), no rank's traceback, exit status 1."""
    import pyarrow.parquet as pq

    tmp, common, _ = setup
    damaged = tmp / "damaged-shards"
    shutil.copytree(loader_corpus, damaged, ignore=shutil.ignore_patterns(".mimo-cache"))
    for row in pq.read_table(damaged / "samples.parquet").to_pylist():
        for member in row["members"]:
            if member["name"].endswith((".jpg", ".png")):
                with open(damaged / row["shard"], "r+b") as shard:
                    shard.seek(member["offset"] + member["size"] // 2)
                    shard.write(b"\0" * 64)
    overrides = [c.replace(str(loader_corpus), str(damaged)) for c in common]
    message = _failed_run(tmp, "damaged-member", *overrides)
    assert "on rank 0 (image dp0 tp0 pp0): DatasetError: " in message, message
    assert re.search(r"sample \d+ member \d+\.img0\.(jpg|png): its bytes changed", message)
    assert f"mimo-shard verify {damaged}" in message


# torch's own message for a CUDA allocation that failed (its first sentences)
TORCH_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
             "79.19 GiB of which 1.06 GiB is free.")
# NCCL out of GPU memory for its buffers, as torch 2.11 words it (ProcessGroupNCCL's message
# and NCCL's last error: NCCL 2.28's "Cuda failure 2 'out of memory'")
NCCL_OOM = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3699, "
            "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.28.9\n"
            "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
            "Cuda failure 2 'out of memory'")


def _stopped(plan, rank: int, error: Exception) -> RunError:
    """What ``Trainer.run`` raises on ``rank`` of ``plan``'s layout (on the CPU) when its step
    raises ``error`` (the trainer's loop alone, in this process: no model)."""
    from types import SimpleNamespace

    from mimo_train.training.trainer import Trainer

    def fail():
        raise error
    trainer = Trainer.__new__(Trainer)
    trainer.plan, trainer.rank, trainer.doing = plan, rank, "step 4"
    trainer.unsettled = None                    # no step done before the failing one
    trainer.device = torch.device("cpu")
    trainer.infra = SimpleNamespace(role=plan.layout.role(rank))
    trainer.loader = trainer.valid_loader = None
    trainer._train = fail
    with pytest.raises(RunError) as stopped:
        trainer.run()
    return stopped.value


# (config, overrides, {rank: (where, the overrides its message offers)}): a tower and a
# language model with TP and DP; the tower frozen; Qwen3-VL (deepstack: no full recompute of
# its language model); packed rows under TP (no sequence parallelism); the language model's
# last pipeline stage alone makes the loss; LoRA's optimizer state is not split
OUT_OF_MEMORY = {
    "tp_dp": ("qwen2_vl_finetune.yaml", ["model.freeze=[]", "layout=image=dp2;language=tp2",
                                         "train.micro_batch_size=2"],
              {1: ("image dp1 tp0 pp0", ["model.encoders.image.recompute=full",
                                         "optimizer.modules.image.distributed=true"]),
               2: ("language dp0 tp0 pp0", ["model.language.recompute=full",
                                            "model.language.sequence_parallel=true"])}),
    "frozen_tower": ("qwen2_vl_finetune.yaml", ["layout=image=dp2;language=tp2",
                                                "train.micro_batch_size=2"],
                     {1: ("image dp1 tp0 pp0", [])}),
    "deepstack": ("qwen3_vl_finetune.yaml", ["model.freeze=[]"],
                  {1: ("language dp0 tp0 pp0", ["model.language.loss_chunk_tokens=4096",
                                                "train.micro_batch_size=1"])}),
    "packed_tp": ("images_audio_noncolocated.yaml",
                  ["layout=image=dp1;audio=dp1;language=tp2"],
                  {3: ("language dp0 tp1 pp0", ["model.language.recompute=full",
                                                "train.micro_batch_size=2"])}),
    "lora_pp": ("qwen2_vl_lora.yaml", ["layout=image=dp1;language=pp2,dp2",
                                       "train.micro_batch_size=8", "train.global_batch_size=32"],
                {1: ("language dp0 tp0 pp0", ["model.language.recompute=full",
                                              "train.micro_batch_size=4"]),
                 3: ("language dp0 tp0 pp1", ["model.language.recompute=full",
                                              "model.language.loss_chunk_tokens=4096",
                                              "train.micro_batch_size=4"])}),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_MEMORY))
def test_a_rank_out_of_gpu_memory_says_what_would_lower_it(case):
    """A rank whose step runs out of GPU memory stops the run with torch's message and, not
    a traceback (it is no bug), the overrides that would lower that rank's memory from the
    run's own settings: each one the run takes (the rules and the layout's batch check) and
    that changes what the rank holds; a setting a rule refuses for this model or run, or one
    that lowers nothing there, is not offered; then the layout advisor's command, which
    mimo-inspect parses. NCCL out of memory for its buffers (a collective's error, not torch's
    OutOfMemoryError) is said the same way, not as a lost peer. Any other exception of
    torch's keeps its traceback."""
    from mimo_data.loading.loader import variable_token_modalities
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve

    name, run, ranks = OUT_OF_MEMORY[case]
    path = REPO / "configs" / "train" / name
    plan = resolve(TrainConfig.load(str(path), run))
    for rank, (where, wanted) in ranks.items():
        error = _stopped(plan, rank, torch.OutOfMemoryError(TORCH_OOM))
        message = str(error)
        assert message.startswith(
            f"training stopped in step 4 on rank {rank} ({where}): out of GPU memory "
            f"(OutOfMemoryError: {TORCH_OOM}); to fit, from this run's settings: "), message
        assert not error.details
        # NCCL's buffers out of memory: the same advice, NCCL's own lines kept, no lost peer
        nccl = _stopped(plan, rank, torch.distributed.DistBackendError(NCCL_OOM))
        cause = "; ".join(NCCL_OOM.splitlines())
        assert str(nccl) == message.replace(f"OutOfMemoryError: {TORCH_OOM}",
                                            f"DistBackendError: {cause}"), str(nccl)
        assert not nccl.details and not nccl.peer_lost
        overrides = re.findall(r"(?:: |; )([a-z_.]+=[^ ;]+) \(", message)
        assert overrides == wanted or overrides == [*wanted, "train.micro_batch_size=1"], \
            message
        for override in overrides:          # each one is taken, and changes the plan
            changed = resolve(TrainConfig.load(str(path), [*run, override]))
            train = changed.config.train
            changed.layout.validate(changed.layout.world_size, train.global_batch_size,
                                    train.micro_batch_size,
                                    variable_token_modalities(changed.preprocess),
                                    modalities=list(changed.preprocess.modalities),
                                    split_media=changed.config.data.split_media)
            assert changed != plan, override
        _assert_advisor_command(plan, message)
    bug = _stopped(plan, 0, RuntimeError("CUDA error: an illegal memory access"))
    assert "to fit" not in str(bug) and "Traceback" in bug.details
    lost = _stopped(plan, 0, torch.distributed.DistBackendError(
        NCCL_OOM.replace("Cuda failure 2 'out of memory'", "remote process exited")))
    assert "to fit" not in str(lost) and lost.peer_lost


def _assert_advisor_command(plan, message: str) -> None:
    """``message`` ends with the layout advisor's command for ``plan``'s run, as mimo-inspect
    parses it."""
    import shlex

    from mimo_data.inspect.cli import _parser
    from mimo_data.loading.layout import Layout
    command = re.search(r"(mimo-inspect plan .*) \(TRAIN\.yaml: [^)]*\)$", message)
    assert command, message
    args = _parser().parse_args(shlex.split(command.group(1))[1:])
    assert (args.command, args.directory, args.config, args.model, args.gpus) == (
        "plan", plan.config.data.datasets[0], plan.config.data.preprocess, "TRAIN.yaml",
        plan.layout.world_size)
    assert Layout.parse(args.layout) == plan.layout and args.packing == plan.config.data.packing
    assert (args.global_batch_size, args.micro_batch_size) == (
        plan.config.train.global_batch_size, plan.config.train.micro_batch_size)


def test_a_model_or_optimizer_that_does_not_fit_at_start_up_names_the_advisor():
    """Out of GPU memory while the model or its optimizer is built (the start-up phases),
    torch's or NCCL's: the error, gathered from the ranks, is its cause and the layout
    advisor's command for the run; other errors pass as they are."""
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.training.trainer import Trainer

    plan = resolve(TrainConfig.load(str(REPO / "configs" / "train" / "qwen2_vl_finetune.yaml"),
                                    ["layout=image=dp2;language=tp2"]))
    trainer = Trainer.__new__(Trainer)
    trainer.plan, trainer.device = plan, torch.device("cpu")

    def build(error):
        raise error
    with pytest.raises(torch.OutOfMemoryError) as stopped:
        trainer._sized(build, torch.OutOfMemoryError(TORCH_OOM))
    message = str(stopped.value)
    assert message.startswith(f"{TORCH_OOM}; the layout advisor says which layouts and "
                              "settings fit: mimo-inspect plan "), message
    _assert_advisor_command(plan, message)
    # NCCL out of memory as the build's first collectives make its buffers: the same, its
    # lines as one (the phase gathers one line a rank)
    with pytest.raises(torch.OutOfMemoryError) as stopped:
        trainer._sized(build, torch.distributed.DistBackendError(NCCL_OOM))
    message = str(stopped.value)
    assert message.startswith("; ".join(NCCL_OOM.splitlines()) + "; the layout advisor says "
                              "which layouts and settings fit: mimo-inspect plan "), message
    _assert_advisor_command(plan, message)
    lost = torch.distributed.DistBackendError(NCCL_OOM.replace("out of memory", "unspecified"))
    with pytest.raises(torch.distributed.DistBackendError) as stopped:
        trainer._sized(build, lost)
    assert stopped.value is lost
    with pytest.raises(ValueError, match="^not a memory error$"):
        trainer._sized(build, ValueError("not a memory error"))


def test_the_step_done_before_a_failure_is_said(capsys):
    """A step's line waits for the next step's settling (its values read while that step's
    passes are queued): a failure in that next step (a rank gone) first says the done step's
    world loss and trained tokens on rank 0, which it holds without the others; a step
    between logging steps stays unsaid, as it would have."""
    from types import SimpleNamespace

    from mimo_train.components.metrics import Metrics, Readings, StepValues
    from mimo_train.errors import RunError
    from mimo_train.training.trainer import Trainer

    def failing():
        raise RuntimeError("Connection closed by peer")
    # (a failure after step 4's own work, its save or the signals' agreement: not said)
    for interval, doing, said in ((1, "step 5", True), (3, "step 5", False),
                                  (1, "step 4", False)):
        trainer = Trainer.__new__(Trainer)
        trainer.metrics = Metrics.__new__(Metrics)
        trainer.metrics.rank0, trainer.metrics.log_interval = True, interval
        trainer.unsettled = StepValues(4, Readings({"sums": torch.tensor([24.0, 8.0])}),
                                       timer=None, forward=[], global_batch_size=8)
        trainer._train = failing
        trainer.infra = SimpleNamespace(role=SimpleNamespace(modules=[]))
        trainer.rank, trainer.doing = 1, doing
        trainer.loader = trainer.valid_loader = None
        with pytest.raises(RunError, match=doing):
            trainer.run()
        out = capsys.readouterr().out
        assert (out == "step    4: loss 3.0000  trained tokens 8  (its other figures not "
                "gathered: the run failed in the next step)\n") if said else out == "", out


def test_a_checkpoint_that_cannot_be_written_stops_the_run_with_one_message(ranks, setup):
    """A file in the place of step 3's checkpoint directory: the run stops at that save with
    one message naming the step's checkpoint and rank 0, which makes the directory, exit
    status 1 (every rank stops at once, told by rank 0)."""
    tmp, common, _ = setup
    root = tmp / "unwritable"
    root.mkdir()
    (root / "step_0000003").write_text("in the way")
    job = train_job(ranks, tmp, "unwritable", CONFIG, *common, f"checkpoint.dir={root}",
                    nproc=3)
    assert job.codes[0] == 1, job.explain()
    reports = [text for text in job.ranks.values() if "training stopped in" in text]
    assert len(reports) == 1 and "Traceback" not in "".join(job.ranks.values()), job.explain()
    assert "training stopped in the checkpoint of step 3 on rank " in reports[0] and \
        f"CheckpointError: checkpoint {root / 'step_0000003'} cannot be made (File exists; " \
        "rank 0 makes it): nothing of it is written" in reports[0], reports[0]


def _gated(tmp: Path, root: Path, common: list[str], restarts: int = 0) -> tuple[list, Path]:
    """The command of the 3-rank job under real torchrun (``--max-restarts restarts``)
    through tests/jobs/gated_train.py (``mimo-train`` whose ranks wait before step 2 until the
    returned gate file exists or they got an exit signal themselves), and the gate; its
    records go to ``root``.jsonl."""
    gate = root.with_name(root.name + ".gate")
    return torchrun_command(3, [TESTS / "jobs" / "gated_train.py", gate, "--config",
                                REPO / "configs" / "train" / CONFIG, *common,
                                f"checkpoint.dir={root}", "--records",
                                root.with_suffix(".jsonl")],
                            ["--standalone", "--max-restarts", restarts]), gate


def _until_step_1(agent: subprocess.Popen) -> list[str]:
    """The agent's output up to rank 0's line of step 1."""
    assert agent.stdout is not None
    lines = []
    for line in agent.stdout:
        lines.append(line)
        if line.startswith("step    1:"):
            break
    return lines


@pytest.mark.parametrize("how", ["killed", "ctrl-c"])
def test_a_rank_that_dies_is_reported_once(setup, how):
    """SIGKILL to one worker once step 1 is logged (the kernel's out-of-memory killer does
    that): the job stops with one message saying a rank left without a message, no traceback
    from the ranks left waiting for it; torchrun's restart (``--max-restarts 1``) then trains
    the run again, as the uninterrupted one (the ranks of the new attempt joined over the
    keys of the dead one in torchrun's store, once: a rank connected to a dead address).
    Ctrl-C (SIGINT to the job's process group, a terminal's): one line saying so, no
    traceback from each rank. The ranks wait before step 2 until then
    (tests/jobs/gated_train.py): the run cannot end first."""
    import signal
    tmp, common, full = setup
    command, gate = _gated(tmp, tmp / how, common, restarts=1 if how == "killed" else 0)
    with session(command, cwd=REPO, env={**os.environ, **BASE_ENV}, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True) as agent:
        assert agent.stdout is not None
        lines = _until_step_1(agent)
        if how == "killed":
            os.kill(_children(agent.pid)[1], signal.SIGKILL)          # the audio rank
        else:
            os.killpg(agent.pid, signal.SIGINT)
        gate.touch()
        lines += agent.stdout.readlines()
        code = agent.wait(timeout=120)
    output = "".join(lines)
    assert "[rank" not in output and output.count("Traceback") <= 1, output
    # (the setup validates on the training set, which start-up says, once an attempt)
    assert output.count("is in data.datasets too: the validation loss is of samples the run "
                        "trains on") == (2 if how == "killed" else 1), output
    records = train_records(read_records(tmp / f"{how}.jsonl"))
    if how == "ctrl-c":
        # each record was written as it was read: the run's death keeps step 1's
        assert [r["step"] for r in records] == [1]
        messages = re.findall(r"^mimo-train: interrupted .*$", output, re.MULTILINE)
        assert len(messages) == 1 and "stopped without saving a checkpoint" in messages[0], output
        return
    messages = re.findall(r"^mimo-train: training stopped in .*$", output, re.MULTILINE)
    assert len(messages) == 1, output
    assert "another rank left the job without a message" in messages[0], messages[0]
    # the restart, with no checkpoint saved yet, trained from the start: the whole run's
    # losses (its records written afresh)
    assert code == 0, output
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), output
    assert [r["loss"] for r in records] == pytest.approx(
        [r["loss"] for r in train_records(full)], abs=1e-5)


@pytest.mark.parametrize("target", ["one worker", "the agent"])
def test_a_signal_stops_every_rank_with_a_checkpoint_and_the_run_resumes(ranks, setup, target):
    """Once step 1 is logged, SIGUSR1 to one worker (Slurm's ``--signal``) or SIGTERM to
    torchrun (which forwards it to every worker): every rank stops after the same step, the
    job saves that step's checkpoint and the workers exit 128 + the signal; started again, the
    run continues the uninterrupted run's losses within 1e-5. The ranks wait before step 2
    until the signal has arrived (tests/jobs/gated_train.py): it stops them after step 1 or 2,
    never after the run's end, however late the test sends it."""
    import signal
    tmp, common, full = setup
    root = tmp / f"signal-{target.replace(' ', '-')}"
    # torchrun signals each worker's process group, its DataLoader workers with it: they
    # ignore the run's exit signals (a dead one would fail the step), their rank ends them
    workers = [] if target == "one worker" else ["data.num_workers=1"]
    command, gate = _gated(tmp, root, [*common, *workers])
    sent = signal.SIGUSR1 if target == "one worker" else signal.SIGTERM
    with session(command, cwd=REPO, env={**os.environ, **BASE_ENV}, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True) as agent:
        assert agent.stdout is not None
        lines = _until_step_1(agent)
        os.kill(_children(agent.pid)[-1] if target == "one worker" else agent.pid, sent)
        if target == "one worker":        # the others go on to step 2 and wait for it there
            gate.touch()
        lines += agent.stdout.readlines()
        agent.wait(timeout=120)
    output = "".join(lines)
    stopped = [line for line in lines if f"{sent.name} received: stopped after step" in line]
    assert len(stopped) == 1, output[-4000:]
    step = int(stopped[0].split()[-1])
    assert step in (1, 2) and (root / "latest").read_text() == f"step_{step:07d}", output[-4000:]
    if target == "one worker":        # torchrun reports each worker's exit status
        assert f"exitcode  : {128 + sent.value}" in output, output[-3000:]
        # torchrun's SIGTERM to the ranks still ending once the first exited killed none
        assert "Signal 15" not in output, output[-3000:]
    else:           # the ranks ended their DataLoader workers: torchrun killed no rank
        assert "forcefully exiting" not in output, output[-3000:]
    assert not (root / ".mimo-run").exists(), output[-3000:]        # its claim released
    records = root.with_suffix(".jsonl")
    before = read_records(records)
    assert [r["step"] for r in train_records(before)] == list(range(1, step + 1))
    # resumed with the same --records (the last one given wins): its records are added
    _train(ranks, tmp, f"resumed-{target}", root, *common, "--records", records)
    resumed = read_records(records)
    assert resumed[:len(before)] == before
    assert_continues(resumed[len(before):], full, list(range(step + 1, STEPS + 1)), loss=1e-5,
                      grad_norm_rel=1e-4)


# the memory settings of real sizes each resumed run adds (docs/training.md, "Memory at real
# sizes"), and the start-up line that names them
MEMORY = {
    "dp2": (["optimizer.distributed=true", "model.language.recompute=full",
             "model.encoders.image.recompute=full"],
            "memory: image: distributed optimizer (dp x cp 1: nothing to shard), recompute "
            "full; audio: distributed optimizer (dp x cp 1: nothing to shard); language: "
            "distributed optimizer, recompute full)"),
    # sequence parallelism takes no packed rows (unpacked: the same samples and losses)
    "tp2": (["data.packing=false", "model.language.sequence_parallel=true",
             "model.language.recompute=selective",
             "optimizer.modules={language: {distributed: true, overlap_grad_reduce: true}}"],
            "memory: image: -; audio: -; language: distributed optimizer (dp x cp 1: "
            "nothing to shard), recompute selective, sequence parallel, overlapped grad "
            "reduce)"),
    # context parallelism: packed rows cut over two ranks (the optimizer's state sharded over
    # dp x cp)
    "cp2": (["optimizer.modules={language: {distributed: true}}"],
            "memory: image: -; audio: -; language: distributed optimizer)")}


@pytest.mark.parametrize("language", ["dp2", "tp2", "cp2"])
def test_resume_under_another_language_layout(ranks, setup, language):
    """Saved under image dp1 + audio dp1 + language dp1, resumed with the language model over
    two data-parallel, two tensor-parallel or two context-parallel ranks: the same samples and
    losses. The resumed
    runs also change the memory settings (``MEMORY``: the distributed optimizer, the language
    model's and the image tower's recomputation, sequence parallelism, the overlapped
    reduction), which the start-up line shows. The dp2 and cp2 runs also stop at step 5
    (``train.exit_interval``), checkpointing there with the distributed optimizer's state
    (sharded over dp x cp), which the plain run under the first layout resumes for step 6."""
    tmp, common, full = setup
    root = copy_checkpoint(tmp / "full-ckpt" / "step_0000003", tmp / f"resume-{language}")
    layout = f"layout=image=dp1;audio=dp1;language={language}"
    # (logging every 2 steps: the stop's step 5 is shown all the same, before it is saved)
    stop = ["train.exit_interval=5", "train.log_interval=2"] if language in ("dp2", "cp2") \
        else []
    overrides, line = MEMORY[language]
    job = train_job(ranks, tmp, f"resumed-{language}", CONFIG, f"checkpoint.dir={root}", *common,
                    layout, *stop, *overrides, nproc=4).check()
    assert line in job.stdout, job.stdout
    tp, cp, dp = (2 if language == name else 1 for name in ("tp2", "cp2", "dp2"))
    assert "mimo-train: the checkpoint was saved under layout image=tp1,cp1,pp1,dp1,off0,image;" \
        "audio=tp1,cp1,pp1,dp1,off1,audio;language=tp1,cp1,pp1,dp1,off2 on 3 rank(s), this " \
        "run's is image=tp1,cp1,pp1,dp1,off0,image;audio=tp1,cp1,pp1,dp1,off1,audio;language=" \
        f"tp{tp},cp{cp},pp1,dp{dp},off2 on 4: its weights and optimizer state are resharded " \
        "(the same values), the sample stream goes on after its 12 samples as an " \
        "uninterrupted run's" in job.stdout, job.stdout       # step 3 of 4 samples
    resumed = read_records(tmp / f"resumed-{language}.jsonl")
    steps = [4, 5] if stop else [4, 5, 6]
    # tp2 sums each matmul's halves in another order: ~2e-5 relative on the grad norm
    assert_continues(resumed, full, steps, loss=1e-5, grad_norm_rel=1e-4)
    assert (root / "latest").read_text() == f"step_{steps[-1]:07d}"
    if stop:
        shown = re.findall(r"^step +(\d+): loss", job.stdout, re.MULTILINE)
        assert shown == ["4", "5"], job.stdout
        assert job.stdout.index("step    5: loss") < job.stdout.index(
            f"checkpoint {root / 'step_0000005'}") < job.stdout.index(
            "train.exit_interval 5: stopping at step 5"), job.stdout
        plain = _train(ranks, tmp, f"plain-after-{language}", root, *common)
        assert_continues(plain, full, [6], loss=1e-5, grad_norm_rel=1e-4)


def _first_loss(records) -> float:
    (first,) = [r for r in train_records(records) if r["step"] == 1]
    return first["loss"]


def test_init_from_into_tensor_parallel_language(ranks, setup, frozen):
    """tp1 -> tp2 and tp2 -> tp2 give the first-step loss of tp1 -> tp1 (the colocated
    frozen run). The tp2 checkpoint holds the same weights: its run trains with lr 0."""
    tmp, common, _ = setup
    tp2 = [*[c for c in common if not c.startswith(("train.eval", "data.valid"))],
           "layout=image=dp1;audio=dp1;language=tp2", "train.steps=1", "optimizer.lr=0",
           "optimizer.min_lr=0"]
    start = tmp / "full-ckpt" / "step_0000003"
    from_tp1 = _train(ranks, tmp, "init-tp1-tp2", tmp / "init-tp2", *tp2,
                      f"model.init_from={start}", nproc=4)
    from_tp2 = _train(ranks, tmp, "init-tp2-tp2", tmp / "init-tp2-again", *tp2,
                      f"model.init_from={tmp / 'init-tp2' / 'step_0000001'}", nproc=4)
    reference = _first_loss(frozen["records"])
    assert _first_loss(from_tp1) == pytest.approx(reference, abs=1e-5)
    assert _first_loss(from_tp2) == pytest.approx(reference, abs=1e-5)


@pytest.fixture(scope="module")
def frozen(ranks, setup):
    """``model.init_from`` of the 3-rank step-3 checkpoint into one colocated process (language
    tp1), one step with ``model.freeze=[image]``: its output, records and checkpoint."""
    tmp, common, _ = setup
    start = tmp / "full-ckpt" / "step_0000003"
    overrides = [c for c in common if not c.startswith(("layout=", "train.eval", "data.valid",
                                                        "optimizer.warmup_steps"))]
    job = train_job(ranks, tmp, "frozen", "images_audio_colocated.yaml", *overrides,
                    f"checkpoint.dir={tmp / 'frozen'}", f"model.init_from={start}",
                    "model.freeze=[image]", "train.steps=1", nproc=1).check()
    return {"result": job, "start": start, "after": tmp / "frozen" / "step_0000001",
            "records": read_records(tmp / "frozen.jsonl")}


def test_frozen_module_keeps_its_weights_under_another_layout(frozen):
    """``model.init_from`` loads a 3-rank checkpoint into one colocated process; with
    ``model.freeze=[image]`` a step leaves the vision module's weights exactly as loaded and
    changes the others. The shipped warmup (3 steps) is clamped to this 1-step run."""
    import torch

    from mimo_train.components.checkpoint import load_weights

    result = frozen["result"]
    assert "mimo-train: optimizer.warmup_steps 3 clamped to 0 for a 1-step run" in \
        result.stdout
    assert re.search(r"mimo-train: steps 1 to 1 of global batch \d+, precision \w+, lr "
                     r"[\d.e-]+ \(warmup 0, cosine", result.stdout), result.stdout   # the run's
    # start-up phases, one step, summary: no third-party warning on the way
    assert "Warning" not in result.stderr, result.stderr[-5000:]
    for line in ("process groups ready (", "model built (", "optimizer and schedule ready (",
                 f"weights loaded from {frozen['start']} (", "step    1: loss"):
        assert line in result.stdout, result.stdout
    assert re.search(r"data loaders ready: \d+ samples, \d+ kept.*; \d+ step\(s\) an epoch",
                     result.stdout), result.stdout
    before, after = load_weights(str(frozen["start"])), load_weights(str(frozen["after"]))
    assert set(after) == set(before) == {"image", "audio", "language"}
    for name, weights in after["image"].items():
        assert torch.equal(weights, before["image"][name]), name
    for module in ("audio", "language"):
        changed = [n for n, w in after[module].items() if not torch.equal(w, before[module][n])]
        assert changed, f"{module} did not train"


def _start(ranks, common: list[str], root: Path, *overrides) -> tuple[int, dict]:
    """Start the 3-rank job on checkpoint.dir ``root``: (exit code, {rank: its stderr})."""
    job = train_job(ranks, root.parent, f"{root.name}-start", CONFIG, *common,
                    f"checkpoint.dir={root}", *overrides, nproc=3)
    return job.codes[0], job.ranks


def _refused(code: int, ranks: dict, phase: str) -> str:
    """The job failed at ``phase`` on every rank, rank 0 printed it once, nobody a traceback;
    returns the message."""
    assert code != 0, ranks
    for rank in range(3):
        assert "Traceback" not in ranks[rank], ranks[rank][-3000:]
    assert ranks[1].count("start-up failed") == ranks[2].count("start-up failed") == 0
    assert ranks[0].count("start-up failed") == 1, ranks[0][-3000:]
    message = ranks[0][ranks[0].index("start-up failed"):]
    assert message.startswith(f"start-up failed ({phase}):"), message
    assert "rank(s) [0, 1, 2]: CheckpointError: checkpoint " in message, message
    return message


def _damaged_copy(setup, name: str) -> Path:
    """A copy of the full run's checkpoint.dir (latest: step 6; step 3 complete)."""
    tmp, _, _ = setup
    root = tmp / name
    shutil.copytree(tmp / "full-ckpt", root)
    return root


def test_damaged_files_are_refused_on_every_rank(ranks, setup):
    """Step 6 with a zero-length, a truncated and a missing rank file: every rank stops
    before loading, one message (printed once) names each file and step 3 to use instead."""
    tmp, common, _ = setup
    root = _damaged_copy(setup, "damaged-files")
    step = root / "step_0000006"
    (step / "__0_0.distcp").write_bytes(b"")
    data = (step / "__2_0.distcp").read_bytes()
    (step / "__2_0.distcp").write_bytes(data[: len(data) // 2])
    (step / "__1_0.distcp").unlink()
    message = _refused(*_start(ranks, common, root), "resume")
    saved = (tmp / "full-ckpt" / "step_0000006" / "__2_0.distcp").stat().st_size
    for name in ("__0_0.distcp: empty (0 bytes, ", f"__2_0.distcp: truncated ({saved // 2:,} "
                 f"bytes, {saved:,} saved)", "__1_0.distcp: file missing"):
        assert name in message, message
    assert f"the newest earlier checkpoint is {root / 'step_0000003'}" in message
    assert f"echo step_0000003 > {root / 'latest'}" in message
    assert not (root / ".mimo-run").exists()     # the next run may take the folder at once


@pytest.mark.parametrize("damage", ["zero-length", "truncated", "missing", "bad meta.json",
                                    "bad index", "no manifest"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(setup, damage):
    """Each damage, read in one process (``load_weights``, as mimo-export does): a
    CheckpointError naming the file and step 3 as the newest earlier checkpoint."""
    from mimo_train.components.checkpoint import load_weights
    from mimo_train.errors import CheckpointError

    root = _damaged_copy(setup, f"damaged-{damage.replace(' ', '-')}")
    step = root / "step_0000006"
    name, expected = {
        "zero-length": ("__0_0.distcp", "__0_0.distcp: empty (0 bytes, "),
        "truncated": ("__2_0.distcp", "__2_0.distcp: truncated (1,000 bytes, "),
        "missing": ("__1_0.distcp", "__1_0.distcp: file missing"),
        "bad meta.json": ("meta.json", f"{step / 'meta.json'} is unreadable"),
        "bad index": (".metadata", ".metadata: hash mismatch"),
        "no manifest": ("integrity.json", f"{step / 'integrity.json'} is missing (the save "
                                          "did not finish)")}[damage]
    path = step / name
    if damage in ("missing", "no manifest"):
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif damage == "zero-length":
        path.write_bytes(b"")
    else:
        path.write_bytes(b"\0" * path.stat().st_size)          # zeroed, same size
    with pytest.raises(CheckpointError) as refused:
        load_weights(str(step))
    message = str(refused.value)
    assert message.startswith(f"checkpoint {step} is damaged: "), message
    assert expected in message, message
    assert f"the newest earlier checkpoint is {root / 'step_0000003'}" in message
    if damage == "bad index":       # given as model.init_from (``_load``'s purpose): its folder
        from mimo_train.checkpoint_folders import damaged    # may be another run's: no echo
        init = str(damaged(str(step), expected, init_from=True))
        assert f"the newest earlier checkpoint is {root / 'step_0000003'}: give " \
            f"model.init_from={root / 'step_0000003'}" in init and "echo" not in init, init


def test_mimo_inspect_checkpoint_checks_without_a_run(setup, capsys):
    """``mimo-inspect checkpoint``: the step ``latest`` names, or ``--all`` steps, hashed
    against their manifests in one process: intact ones with what they hold (exit 0); a
    truncated, a changed or an unfinished one named (exit 1; a save left unfinished after the
    step a resume loads is said, and fails nothing), every verdict on stdout and a
    FAIL line a problem on stderr, with the newest intact step before the one latest names to
    resume from (checked: never a later one, which may be another run's); a latest a resume
    refuses (naming no folder, empty, none) said as the resume says it; a path holding no
    checkpoint is a usage error (exit 2)."""
    from mimo_train.inspect_cli import main

    def inspected(*args) -> tuple[int, str, str]:
        code = main(["checkpoint", *map(str, args)])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    tmp, _, _ = setup
    code, out, _ = inspected(tmp / "full-ckpt")
    assert code == 0 and out.startswith(
        f"{tmp / 'full-ckpt'}: 2 step folder(s), step_0000003 to step_0000006; latest: "
        "step_0000006\nstep_0000006: intact: "), out
    assert "every SHA-256 matches integrity.json" in out and "step_0000003" not in \
        out.splitlines()[1], out
    # what it holds: the run's step, samples, batch, layout and world size, from meta.json
    assert re.search(r"\n  step 6 of 6, \d+ samples; global batch \d+; layout .*; world size "
                     r"3", out), out

    root = _damaged_copy(setup, "inspected")
    step = root / "step_0000006"
    saved = (step / "__2_0.distcp").stat().st_size
    (step / "__2_0.distcp").write_bytes((step / "__2_0.distcp").read_bytes()[:1000])
    (step / "meta.json").write_text((step / "meta.json").read_text().replace("6", "7", 1))
    (root / "step_0000009").mkdir()                 # a save killed before its manifest
    (root / "step_0000009" / ".metadata").write_bytes(b"")
    # a later complete step (another run's, say): never the one to resume from instead
    shutil.copytree(root / "step_0000003", root / "step_0000012", copy_function=os.link)
    code, out, err = inspected(root)
    assert code == 1
    assert f"mimo-inspect checkpoint: FAIL step_0000006: __2_0.distcp: truncated (1,000 bytes, " \
        f"{saved:,} saved)\n" in err and "mimo-inspect checkpoint: FAIL step_0000006: " \
        "meta.json: hash mismatch (expected " in err, err
    assert "\nstep_0000006: DAMAGED: __2_0.distcp: truncated " in out, out
    assert "\nstep_0000003: intact: " in out and "step_0000012: intact" not in out, out
    assert out.endswith("the newest intact step to resume from is step_0000003: echo "
                        f"step_0000003 > {root / 'latest'}\n"), out
    code, out, err = inspected(os.path.relpath(root), "--all", "--workers", "2")
    assert code == 1 and "\nstep_0000009: INCOMPLETE: no integrity.json: its save did not " \
        "finish" in out and "; left after step_0000006, which a resume loads: it ignores this " \
        "folder (its save of that step, if any, replaces it; else it may be deleted)" in out \
        and "FAIL step_0000009" not in err, (out, err)
    assert out.endswith(f"step_0000003 > {root / 'latest'}\n"), out
    # each step checked once, said once (the fallback's paths are absolute, --all's relative)
    assert err.count("FAIL step_0000006: meta.json: hash mismatch") == 1 and \
        out.count("step_0000003: intact") == 1, (out, err)
    # latest naming the intact earlier step: a resume is unaffected by the others' damage
    (root / "latest").write_text("step_0000003")
    code, out, _ = inspected(root, "--all")
    assert code == 1 and "resume: latest names step_0000003, which is intact: a resume loads " \
        "it\n" in out and "newest intact step" not in out, out
    # a save left unfinished after it (a preemption while saving) alone: what a resume
    # needs holds (exit 0, no FAIL), the leftover said
    left = tmp / "left-over"
    left.mkdir()
    for name in ("step_0000003", "step_0000009"):
        shutil.copytree(root / name, left / name, copy_function=os.link)
    (left / "latest").write_text("step_0000003")
    code, out, err = inspected(left, "--all")
    assert code == 0 and "FAIL" not in err and "\nstep_0000009: INCOMPLETE: " in out, (out, err)
    # what a resume refuses: a latest naming no folder, an empty one, none
    (root / "latest").write_text("step_0000020")
    code, out, err = inspected(root)
    assert code == 1 and f"FAIL resume: checkpoint {root / 'step_0000020'} is damaged: " \
        f"{root / 'latest'} names it, and there is no such folder" in err, err
    assert "; latest: step_0000020 (no such folder)\n" in out, out
    assert out.endswith("the newest intact step to resume from is step_0000012: echo "
                        f"step_0000012 > {root / 'latest'}\n"), out
    (root / "latest").write_text("")
    code, _, err = inspected(root)
    assert code == 1 and f"FAIL resume: {root / 'latest'} holds '', no step's folder name" in err
    (root / "latest").unlink()
    code, _, err = inspected(root)
    assert code == 1 and "but no 'latest' file, which names the checkpoint to resume" in err
    code, out, _ = inspected(root / "step_0000009")      # one step's folder, unfinished
    assert code == 1 and "INCOMPLETE" in out, out
    code, out, _ = inspected(root / "step_0000003")      # one intact step's folder
    assert code == 0 and "intact" in out and "no intact step" not in out, out
    code, out, _ = inspected(root / "step_0000003", "--json")
    verdict = json.loads(out)
    assert code == 0 and verdict["intact"] and verdict["checkpoints"][0]["meta"]["step"] == 3
    for path, said in ((root / "step_0000003" / "meta.json", "is a file, not a folder"),
                       (tmp / "nothing-here", "nothing-here: no such directory")):
        code, _, err = inspected(path)
        assert code == 2 and said in err, err
    (root / "step_0000003" / "meta.json").unlink()      # one problem: one FAIL line
    code, _, err = inspected(root / "step_0000003")
    assert code == 1 and err.count("FAIL") == 1 and "step_0000003: meta.json: file " \
        "missing or unreadable" in err, err
    from mimo_data.inspect.cli import main as data_main          # without mimo_train
    assert data_main(["checkpoint", str(root)]) == 2
    assert "mimo-inspect checkpoint: error: checking checkpoints needs mimo_train: run the " \
        "mimo-inspect command of a full install" in capsys.readouterr().err


def test_the_checkpoint_named_instead_of_a_damaged_one_is_earlier_and_reads(tmp_path):
    """Not a later step (another run's, left in the folder), nor one whose meta.json does
    not read; with none such, starting over is what is said."""
    from mimo_train.checkpoint_folders import damaged

    for step, meta in ((2, "{}"), (4, "{"), (6, "{}"), (8, "{}")):
        folder = tmp_path / f"step_{step:07d}"
        folder.mkdir()
        (folder / "meta.json").write_text(meta)
        (folder / "integrity.json").write_text("{}")
    message = str(damaged(str(tmp_path / "step_0000006"), "a file is missing"))
    assert f"the newest earlier checkpoint is {tmp_path / 'step_0000002'}: resume from it " \
        f"with 'echo step_0000002 > {tmp_path / 'latest'}'" in message, message
    assert f"no earlier checkpoint is in {tmp_path}: start over in another checkpoint.dir " \
        f"(or remove {tmp_path / 'step_0000002'} and {tmp_path / 'latest'})" in \
        str(damaged(str(tmp_path / "step_0000002"), "a file is missing"))
    # a folder not named step_* (a step copied to best/) has none earlier: one beside it
    assert f"the newest checkpoint beside it is {tmp_path / 'step_0000008'}: resume from it" \
        in str(damaged(str(tmp_path / "best"), "a file is missing"))
    # the earlier ones all unreadable: removing the damaged one alone would lead to them, one
    # refusal after another; and without latest, the step it names is one whose meta.json reads
    from mimo_train.checkpoint_folders import resume_point
    from mimo_train.errors import CheckpointError
    (tmp_path / "step_0000002" / "meta.json").write_text("")
    assert f"no earlier checkpoint is in {tmp_path} that can be resumed (step_0000002, " \
        "step_0000004: no meta.json reads): start over in another checkpoint.dir (or remove " \
        f"them all: rm -r {tmp_path / 'step_*'} {tmp_path / 'latest'})" in \
        str(damaged(str(tmp_path / "step_0000006"), "a file is missing"))
    (tmp_path / "step_0000008" / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match="to resume from step_0000006, run `echo "
                       "step_0000006"):
        resume_point(str(tmp_path))
    (tmp_path / "step_0000006" / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match="holds step_0000004, step_0000006, step_0000008 "
                       "but no 'latest' file, and no meta.json of them reads: none can be "
                       "resumed; start over") as refused:
        resume_point(str(tmp_path))
    assert refused.value.exit_code == 1


def test_latest_naming_a_folder_outside_the_checkpoint_dir_is_refused(tmp_path):
    """``latest`` holds a step folder of its own checkpoint.dir (by name, or by a path into it):
    one naming another run's step (``/other/run/step_N``, ``../other/step_N``) would resume
    that run's checkpoint while mimo-inspect lists it as this folder's; refused, naming
    model.init_from for a branch, with the exit status of a damaged checkpoint (1), as an empty
    one is."""
    from mimo_train.checkpoint_folders import latest, resume_point
    from mimo_train.errors import CheckpointError

    run, other = tmp_path / "run", tmp_path / "other"
    for root in (run, other):
        (root / "step_0000004").mkdir(parents=True)
        (root / "step_0000004" / "integrity.json").write_text("{}")
    (tmp_path / "link").symlink_to(run)                # the folder by a link to it
    for name in ("step_0000004", " step_0000004\n", str(run / "step_0000004"),
                 "./step_0000004", str(tmp_path / "link" / "step_0000004")):
        (run / "latest").write_text(name)
        assert os.path.realpath(resume_point(str(run))) == str(run / "step_0000004")
    for name in (str(other / "step_0000004"), "../other/step_0000004"):
        (run / "latest").write_text(name)
        with pytest.raises(CheckpointError, match="not a folder of checkpoint.dir") as refused:
            latest(str(run))
        assert f"model.init_from={other / 'step_0000004'}" in str(refused.value)
        assert refused.value.exit_code == 1         # a damaged latest, as one naming nothing
    for text in ("", "\n"):                    # an empty latest: the same exit status
        (run / "latest").write_text(text)
        with pytest.raises(CheckpointError, match="no step's folder name") as refused:
            latest(str(run))
        assert refused.value.exit_code == 1


def test_what_is_given_for_a_step_s_checkpoint_is_named(setup, tmp_path):
    """What users give model.init_from in place of a step's folder (read as it reads it, no
    tensor): a run's checkpoint.dir is taken for its latest step, as mimo-export takes it, and
    without ``latest`` names its newest step; a transformers model folder names
    model.pretrained; a path that is nothing says so; none is called damaged."""
    from mimo_train.checkpoint_folders import step_of
    from mimo_train.components.checkpoint_fit import check
    from mimo_train.errors import CheckpointError

    tmp, _, _ = setup
    assert step_of(str(tmp / "full-ckpt")) == str(tmp / "full-ckpt" / "step_0000006")
    assert step_of(str(tmp / "full-ckpt" / "step_0000003")) == \
        str(tmp / "full-ckpt" / "step_0000003")
    unnamed = tmp_path / "unnamed"
    (unnamed / "step_0000003").mkdir(parents=True)
    model = REPO / "assets" / "models" / "tiny-qwen2"
    for given, expected in (
            (unnamed, f"{unnamed} holds a run's checkpoints (a checkpoint.dir) and no "
             f"'latest' naming one: give one step's folder, e.g. {unnamed / 'step_0000003'}"),
            (model, f"{model} is a transformers model (config.json and its weights), not a "
             "mimo checkpoint: give it as model.pretrained"),
            (tmp_path / "nothing", f"checkpoint {tmp_path / 'nothing'}: no such directory"),
            # a run's own folder above its checkpoint.dir: that folder named, nothing "damaged"
            # (nor anything to delete)
            (tmp, f"{tmp} holds no mimo checkpoint (no meta.json, no step folders, no latest): "
             "give a run's checkpoint.dir or one of its step_NNNNNNN folders, e.g. "),
            (REPO / "configs", f"{REPO / 'configs'} holds no mimo checkpoint")):
        with pytest.raises(CheckpointError) as refused:
            check(str(given), None, None)
        assert str(refused.value).startswith(expected), refused.value
        assert "damaged" not in str(refused.value) and "remove" not in str(refused.value)


def test_keep_last_deletes_only_older_complete_checkpoints(tmp_path):
    """``checkpoint.keep_last``'s pruning (rank 0, once ``latest`` names the save just
    completed): the newest N complete checkpoints up to it stay, and whatever ``latest``
    names; older ones go, with the interrupted saves among them; later ones (another run's,
    or being written) stay."""
    from mimo_train.components.checkpoint import prune

    for step, complete in ((2, True), (4, False), (6, True), (8, True), (10, True),
                           (12, True)):
        (tmp_path / f"step_{step:07d}").mkdir()
        if complete:
            (tmp_path / f"step_{step:07d}" / "integrity.json").write_text("{}")
    (tmp_path / "latest").write_text("step_0000010")
    deleted = prune(str(tmp_path), 2, str(tmp_path / "step_0000010"))
    assert [os.path.basename(d) for d in deleted] == ["step_0000002", "step_0000004",
                                                      "step_0000006"]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_0000008", "step_0000010", "step_0000012"]
    (tmp_path / "latest").write_text("step_0000008")        # latest names an older one
    assert prune(str(tmp_path), 1, str(tmp_path / "step_0000010")) == []
    # an interrupted save between the kept ones counts for none of the N
    other = tmp_path / "other"
    for step, complete in ((6, True), (8, False), (10, True)):
        (other / f"step_{step:07d}").mkdir(parents=True)
        if complete:
            (other / f"step_{step:07d}" / "integrity.json").write_text("{}")
    (other / "latest").write_text("step_0000010")
    assert prune(str(other), 2, str(other / "step_0000010")) == []
    # a run set back (latest) from step 7 to step 4, saving 6 and 8 under keep_last 2: the
    # continuation's step 7 is neither one of its newest 2 nor deleted, and its own 6 stays
    # (7 counted, the run's own 6 went)
    # (a save interrupted at step 5, anyone's, goes as before)
    back = tmp_path / "back"
    for step in (2, 4, 5, 6, 7, 8):
        (back / f"step_{step:07d}").mkdir(parents=True)
        if step != 5:
            (back / f"step_{step:07d}" / "integrity.json").write_text("{}")
    (back / "latest").write_text("step_0000008")
    deleted = prune(str(back), 2, str(back / "step_0000008"),
                    frozenset({"step_0000007"}))
    assert [os.path.basename(d) for d in deleted] == ["step_0000002", "step_0000004",
                                                      "step_0000005"]
    assert sorted(p.name for p in back.glob("step_*")) == [
        "step_0000006", "step_0000007", "step_0000008"]


def test_a_run_set_back_names_the_later_step_folders(tmp_path, capsys):
    """Resuming an earlier checkpoint than the folder's newest (``latest`` set back): the
    later complete checkpoints are named at start-up (the first four), with what becomes of
    them, not an interrupted save (step 9's); the run's saves reach ``prune`` with them
    (those set back from, but the ones it wrote again), and each save's meta.json names them,
    so that a later resume of it keeps them out too."""
    from mimo_train.components import checkpoint
    from mimo_train.components.checkpoint import Saver
    for step in (2, 4, 6, 7, 8, 9, 10, 11):
        (tmp_path / f"step_{step:07d}").mkdir()
        if step != 9:
            (tmp_path / f"step_{step:07d}" / "integrity.json").write_text("{}")
    saver = Saver(str(tmp_path), asynchronous=False, keep_last=2,
                  resumed=str(tmp_path / "step_0000004"))
    assert capsys.readouterr().out == (
        f"mimo-train: {tmp_path} holds step folders after step_0000004, which this run resumed: "
        "step_0000006, step_0000007, step_0000008, step_0000010 ... (the run that went on from "
        "it, set back by latest): this run writes its own over those it reaches, and "
        "checkpoint.keep_last neither counts nor deletes the others\n")
    Saver(str(tmp_path), asynchronous=False, keep_last=2, resumed=str(tmp_path / "step_0000011"))
    assert capsys.readouterr().out == ""

    class Done:
        def execute_sync(self):
            pass
    seen = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint, "_save_request",
                      lambda *args: (seen.append((args[4], args[-1])), Done())[1])
        saver.save(6, None, {"step": 6})
        saver.save(8, None, {"step": 8})
    names = [f"step_{n:07d}" for n in (7, 8, 10, 11)]
    assert seen == [({"step": 6, "set_back_from": names},
                     frozenset(names)),
                    ({"step": 8, "set_back_from": [names[0], *names[2:]]},
                     frozenset([names[0], *names[2:]]))]
    # that run's step 8 resumed later: step 7, set back from before, is still not its own
    (tmp_path / "step_0000008" / "meta.json").write_text(json.dumps(seen[1][0]))
    capsys.readouterr()
    again = Saver(str(tmp_path), asynchronous=False, keep_last=2,
                  resumed=str(tmp_path / "step_0000008"))
    assert again.abandoned == {"step_0000007", "step_0000010", "step_0000011"}


def test_resuming_a_frozen_part_as_trained_is_refused_in_config_terms(frozen):
    """The checkpoint of a ``model.freeze=[image]`` run resumed with the image module trained
    (``[]``, or only its tower frozen): refused in the check phase naming model.freeze both
    ways and model.init_from (its optimizer holds no state for the image module); with the
    same freeze, or more frozen, it passes the check."""
    from types import SimpleNamespace

    from mimo_train.components.checkpoint_fit import _check_frozen, check
    from mimo_train.errors import CheckpointError

    step = frozen["after"]
    model = SimpleNamespace(sharded_state_dict=dict, mimo_config=SimpleNamespace(
        modality_submodules_spec={"image": None, "audio": None}))
    for freeze in ([], ["image.encoder"]):
        with pytest.raises(CheckpointError) as refused:
            check(str(step), model, 4, freeze)
        assert str(refused.value).startswith(
            f"checkpoint {step} was saved by a run with model.freeze image, this run has "
            f"{', '.join(freeze) or 'none'}: "
            "image would train (or be adapted), and a frozen part has no optimizer "
            "state to resume")
        assert f"model.init_from={step}" in str(refused.value)
    assert check(str(step), model, 4, ["image"])["step"] == 1
    assert check(str(step), model, 4, ["image", "audio"])["step"] == 1
    # a part the checkpoint holds no weights of (a projection none) froze nothing there
    meta = json.loads((step / "meta.json").read_text())
    meta["config"]["model"]["freeze"] = ["image.projection"]
    _check_frozen(str(step), meta, {"modality_submodules.image.module.encoders.x": None}, [])
    with pytest.raises(CheckpointError, match="image.projection would train"):
        _check_frozen(str(step), meta, {"modality_submodules.image.module.input_projections.x":
                                        None}, [])
    # its tower frozen, resumed with the whole module frozen: more frozen, taken
    meta["config"]["model"]["freeze"] = ["image.encoder"]
    _check_frozen(str(step), meta, {"modality_submodules.image.module.encoders.x": None},
                  ["image"])
    assert check(str(step), model, None)["step"] == 1         # model.init_from: any freeze
    # LoRA newly on the frozen tower (which then trains its adapters): said as the adapters
    # the checkpoint lacks, not as the freeze (whose remedy, freezing it, refuses LoRA there)
    import torch
    from megatron.core import dist_checkpointing

    from mimo_train.mcore import ShardedTensor
    adapter = "modality_submodules.image.module.encoders.x.lora.a.weight"
    weights = {key: ShardedTensor.from_rank_offsets(key, torch.empty(held.global_shape))
               for key, held in dist_checkpointing.load_tensors_metadata(str(step)).items()
               if key.startswith("modality_submodules.") or key.startswith("language_model.")}
    adapted = SimpleNamespace(mimo_config=model.mimo_config, sharded_state_dict=lambda: {
        **weights, "a": ShardedTensor.from_rank_offsets(adapter, torch.ones(2))})
    with pytest.raises(CheckpointError, match=r"lacks 1 LoRA adapter weight\(s\) of this run, "
                       r"e\.g\. \[.modality_submodules\.image\.module\.encoders\.x\.lora\.a\."
                       r"weight.\]: it was saved without LoRA adapters"):
        check(str(step), adapted, 4, [])


def test_a_checkpoint_with_modules_this_model_lacks_is_refused_naming_them(setup):
    """The image + audio + language checkpoint resumed by a model without audio: refused in
    the check phase naming the module (not later as a loader state "for other data"); its
    weights into such a model (``model.init_from``) are not refused for it."""
    from types import SimpleNamespace

    from mimo_train.components.checkpoint_fit import check
    from mimo_train.errors import CheckpointError

    tmp, _, _ = setup
    step = tmp / "full-ckpt" / "step_0000003"
    model = SimpleNamespace(sharded_state_dict=dict, mimo_config=SimpleNamespace(
        modality_submodules_spec={"image": None}))
    with pytest.raises(CheckpointError) as refused:
        check(str(step), model, 4)
    assert str(refused.value).startswith(
        f"checkpoint {step} holds module(s) audio that this run's model lacks (the "
        "checkpoint's modules: audio, image, language; this run's: image, language)")
    assert f"model.init_from={step}" in str(refused.value)
    assert check(str(step), model, None)["step"] == 3
    # and the other way: a model of a module the checkpoint lacks (another run's
    # checkpoint.dir), said alike on every rank, those without that module too
    more = SimpleNamespace(sharded_state_dict=dict, mimo_config=SimpleNamespace(
        modality_submodules_spec={"image": None, "audio": None, "video": None}))
    with pytest.raises(CheckpointError) as refused:
        check(str(step), more, 4)
    assert str(refused.value) == (
        f"checkpoint {step} holds no weight of module(s) video of this run's model (the "
        "checkpoint's modules: audio, image, language): it was saved by a run without them. "
        "Resume with the checkpoint's model.encoders and layout, or train this model in "
        "another checkpoint.dir")
