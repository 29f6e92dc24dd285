"""Exactly-once, resume and training parity with videos in the corpus.

The sample corpus with ``video.jsonl`` beside its five inputs (built once, shards of 16), a
preprocessing config that expands images (small), audio and videos (small frames) with the
SmolLM2 tokenizer, sequential positions; the random-init ``qwen2_vl`` image tower serves video
beside images (``image=dp1,video``). Reusing the runners of the video-less tests, every job on
forked ranks (``tests/support/launch.py``):

- ``tests/jobs/loader_dist.py``: one epoch on 3 ranks (the image/video encoder on
  its own rank, decoding the clips) serves every kept sample once, video samples included; the
  state saved after two steps resumed on 4 ranks under another layout (image/video dp2 fan-in)
  gives exactly the remaining steps, keys and tensors;
- ``tests/jobs/train_parity.py``: the colocated step and image/video dp2 + audio dp1 -> language
  dp1 (variable counts fanned in) give the same loss and gradients (1e-5); the batch holds an
  image, a video, an audio clip;
- ``mimo_train``: the step-2 checkpoint of a colocated 4-step run, resumed on 3
  ranks (image/video, audio and language each on its own rank), gives the uninterrupted run's
  tokens and losses (1e-5) for steps 3-4, which hold video samples.

What is kept is read from the inputs (``videos/catalog.json``: a clip of fewer frames than the
tower's temporal patch is dropped) and from samples.parquet's video columns, not from the
loader's token table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import CORPUS_DIR, REPO, build_dataset, scratch
from support.launch import TESTS
from support.runs import assert_continues, compare, copy_checkpoint, step, train, train_records

LOADER_RUNNER = TESTS / "jobs" / "loader_dist.py"
LOADER_BATCH = 8                # the loader jobs' global batch (tests/test_loader_dist.py's)
SAVE_AFTER = 2
# the parity step's model (tests/test_train_parity.py's, its batch and seed set below)
MODEL = ["model.language.num_layers=2", "model.language.hidden_size=32",
         "model.language.num_attention_heads=2", "optimizer.warmup_steps=0", "train.steps=1"]
PARITY_BATCH = 4
# train.seed 2: the first global batch of 4 holds an image, a video and an audio sample; steps
# 3-4 (the resumed ones) hold video samples (both asserted below)
SEED = 2
TEMPORAL_PATCH = 2
VIDEO = {"token": "<|video_pad|>", "patch_size": 14, "merge_size": 2,
         "temporal_patch_size": TEMPORAL_PATCH, "fps": 2.0, "min_frames": 4, "max_frames": 16,
         "min_pixels": 3136, "max_pixels": 12544}
COLOCATED = "language=dp1;image=dp1,off0,video;audio=dp1,off0"
VIDEO_PIXELS = "/modality_inputs/video/video/pixel_values_videos"
CONFIG = "images_audio_noncolocated.yaml"      # the trainer's config (tests/test_train_run.py's)


@pytest.fixture(scope="module")
def video_corpus(tmp_path_factory, corpus_inputs) -> Path:
    """The whole corpus and video.jsonl built once in shards of 16 samples."""
    out = tmp_path_factory.mktemp("video-corpus") / "shards"
    build_dataset([*corpus_inputs, str(CORPUS_DIR / "video.jsonl")], out,
                  max_samples_per_shard=16)
    return out


@pytest.fixture(scope="module")
def video_config(tmp_path_factory) -> Path:
    """configs/preprocess.yaml with the SmolLM2 tokenizer, small images and ``modalities.video``.
    """
    data = yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())
    data["tokenizer"] = str(REPO / "assets" / "tokenizer" / "smollm2")
    data["modalities"]["image"].update(max_pixels=12544)
    data["modalities"]["video"] = dict(VIDEO)
    path = tmp_path_factory.mktemp("video-config") / "preprocess.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def table(video_corpus) -> list[dict]:
    return pq.read_table(video_corpus / "samples.parquet").to_pylist()


@pytest.fixture(scope="module")
def video_keys(table) -> set[str]:
    """Keys of the samples with a video (samples.parquet's video columns)."""
    keys = {row["key"] for row in table if row["video_duration"]}
    assert keys and all(len(row["video_width"]) == len(row["video_duration"]) for row in table)
    return keys


@pytest.fixture(scope="module")
def kept(table, corpus) -> set[str]:
    """Global keys ("0/KEY") the config keeps, read from the inputs: every sample but those of
    a clip with fewer frames than a temporal patch (the catalog's frame counts)."""
    frames = {e["path"]: e["frames"] for e in
              json.loads((corpus / "videos" / "catalog.json").read_text())}
    short = set()
    for line in (corpus / "video.jsonl").read_text().splitlines():
        record = json.loads(line)
        clips = record.get("videos", record.get("video")) or []
        clips = [clips] if isinstance(clips, str) else clips
        if any(frames.get(c, TEMPORAL_PATCH) < TEMPORAL_PATCH for c in clips):
            short.add(record["id"])
    assert short, "the corpus has no clip shorter than a temporal patch"
    assert short <= {row["id"] for row in table}           # built, then dropped by the config
    return {f"0/{row['key']}" for row in table if row["id"] not in short}


def test_smollm2_gets_a_video_token_beside_the_image_token(video_config):
    from transformers import AutoTokenizer

    from mimo_data.preprocess.chat_tokens import load_tokenizer
    from mimo_data.preprocess.config import PreprocessConfig

    plain = AutoTokenizer.from_pretrained(str(REPO / "assets" / "tokenizer" / "smollm2"))
    added = load_tokenizer(PreprocessConfig.from_yaml(str(video_config)))
    tokens = ("<|image_pad|>", "<|video_pad|>", "<|audio_pad|>")
    assert not set(tokens) & set(plain.get_vocab())
    ids = [added.convert_tokens_to_ids(t) for t in tokens]
    assert len(set(ids)) == 3 and min(ids) >= len(plain)
    assert added.tokenize("a <|video_pad|> b").count("<|video_pad|>") == 1


# ------------------------------------------------------------------------------ exactly once

def _loader_job(ranks, nproc: int, out: Path, *args) -> dict:
    """``tests/jobs/loader_dist.py`` on ``nproc`` ranks (as tests/test_loader_dist.py runs it:
    its global batch, seed 21); the JSON result rank 0 wrote to ``out``."""
    ranks.run(nproc, [LOADER_RUNNER, "--out", out, "--global-batch-size", LOADER_BATCH,
                      "--seed", 21, *args], out.with_name(f"{out.stem}-logs")).check()
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def loader_runs(ranks, video_corpus, video_config, tmp_path_factory):
    folder = tmp_path_factory.mktemp("video-dist")
    common = ["--dataset", video_corpus, "--config", video_config, "--micro-batch-size", 2]
    first = _loader_job(ranks, 3, folder / "first.json", *common, "--layout",
                        "image=dp1,video;audio=dp1;language=dp1", "--workers", 1,
                        "--save-after-steps", SAVE_AFTER)
    (folder / "state.json").write_text(json.dumps(first["state"]))
    second = _loader_job(ranks, 4, folder / "second.json", *common, "--layout",
                         "image=dp2,video;audio=dp1;language=dp1", "--state",
                         folder / "state.json")
    return first, second


def test_one_epoch_with_video_serves_every_kept_sample_once(loader_runs, kept, video_keys):
    first, _ = loader_runs
    assert first["problems"] == [] and first["world_size"] == 3
    assert set(first["modules"]) == {"language", "image", "audio"}
    for module in ("language", "image", "audio"):
        steps = first["modules"][module]
        assert [s["step"] for s in steps] == list(range(len(kept) // LOADER_BATCH)), module
        served = [key for step in steps for key in step["keys"]]
        assert len(served) == len(set(served)) and set(served) <= kept, module
        assert len(kept - set(served)) == len(kept) % LOADER_BATCH, module
    served = {key.split("/", 1)[1] for s in first["modules"]["language"] for key in s["keys"]}
    assert len(served & video_keys) >= 2, "no video sample served"
    # the image module decoded the clips: exactly the steps holding a video sample (by
    # samples.parquet) have video pixels among its tensors
    with_video = [bool({k.split("/", 1)[1] for k in s["keys"]} & video_keys)
                  for s in first["modules"]["image"]]
    assert with_video == [VIDEO_PIXELS in s["digests"] for s in first["modules"]["image"]]
    assert {"/input_ids", "/labels"} <= set(first["modules"]["language"][0]["digests"])
    assert (first["state"]["step"], first["state"]["micro_batch"]) == (SAVE_AFTER, 0)


def test_resume_with_video_on_another_layout_continues_exactly(loader_runs):
    first, second = loader_runs
    assert second["problems"] == [] and second["world_size"] == 4
    for module in ("language", "image", "audio"):
        assert second["modules"][module] == first["modules"][module][SAVE_AFTER:], module
    # the resumed steps' video pixels among what was compared
    assert any(VIDEO_PIXELS in s["digests"] for s in second["modules"]["image"])


# ---------------------------------------------------------------------------- step parity

@pytest.fixture(scope="module")
def parity(ranks, video_corpus, video_config, tmp_path_factory):
    """The colocated step on the video corpus, and the initial weights other layouts load."""
    with scratch(tmp_path_factory, "video-parity") as tmp:
        common = [f"data.datasets=[{video_corpus}]", f"data.preprocess={video_config}",
                  "model.encoders.audio.hidden_size=16", *MODEL,
                  f"train.global_batch_size={PARITY_BATCH}", f"train.seed={SEED}"]
        reference = step(ranks, tmp / "colocated", 1, f"layout={COLOCATED}",
                         f"train.micro_batch_size={PARITY_BATCH}", *common,
                         save_init=tmp / "init")
        yield tmp, common, reference, str(tmp / "init" / "step_0000000")


def test_parity_batch_holds_video_image_and_audio(video_corpus, video_config, video_keys):
    from mimo_data.loading.loader import build_loader

    loader = build_loader([video_corpus], video_config, COLOCATED, 0, 1, PARITY_BATCH,
                          PARITY_BATCH, seed=SEED)
    batch, metadata = next(iter(loader))
    loader.close()
    keys = {key.split("/", 1)[1] for key in metadata["keys"]}
    videos = keys & video_keys
    assert videos, f"no video sample in the parity batch {sorted(keys)}"
    assert any(metadata["token_counts"]["image"]) and any(metadata["token_counts"]["audio"])
    from mimo_data.preprocess.chat_tokens import load_tokenizer
    from mimo_data.preprocess.config import PreprocessConfig

    pad = load_tokenizer(PreprocessConfig.from_yaml(str(video_config))).convert_tokens_to_ids(
        "<|video_pad|>")
    rows = [i for i, key in enumerate(metadata["keys"]) if key.split("/", 1)[1] in videos]
    assert all(int((batch["input_ids"][i] == pad).sum()) > 0 for i in rows)
    assert int((batch["input_ids"] == pad).sum()) == sum(
        n for counts in metadata["token_counts"]["video"] for n in counts)
    assert batch["modality_inputs"]["video"]


def test_video_fan_in_step_matches_colocated(ranks, parity):
    """Images and videos of variable counts over two encoder DP ranks, audio on one, into
    language dp1."""
    tmp, common, reference, init = parity
    fan_in = step(ranks, tmp / "fan-in", 4, "layout=image=dp2,video;audio=dp1;language=dp1",
                  "train.micro_batch_size=2", f"model.init_from={init}", *common)
    compare(reference, fan_in, "image+video dp2 + audio dp1 -> language dp1")
    assert {"image", "audio", "language"} == set(reference["grads"])


# --------------------------------------------------------------------------------- resume

def test_resume_with_video_gives_the_uninterrupted_losses(ranks, video_corpus, video_config,
                                                          video_keys, tmp_path_factory):
    from mimo_data.loading.loader import build_loader

    # the steps the resumed run trains hold video samples (the sample order is the layout's
    # and the packing's business only within a step)
    loader = build_loader([video_corpus], video_config, COLOCATED, 0, 1, PARITY_BATCH,
                          PARITY_BATCH, seed=SEED, decode_media=False)
    iterator = iter(loader)
    steps = [{k.split("/", 1)[1] for k in next(iterator)[1]["keys"]} for _ in range(4)]
    loader.close()
    assert (steps[2] | steps[3]) & video_keys, steps

    with scratch(tmp_path_factory, "video-resume") as tmp:
        common = [f"data.datasets=[{video_corpus}]", f"data.preprocess={video_config}",
                  "train.steps=4", "checkpoint.interval=2", "optimizer.warmup_steps=1",
                  f"train.global_batch_size={PARITY_BATCH}", "train.micro_batch_size=2",
                  f"train.seed={SEED}"]
        # uninterrupted: one colocated process (one start-up instead of three)
        full = train(ranks, tmp, "full", CONFIG, f"checkpoint.dir={tmp / 'full-ckpt'}",
                     *common, f"layout={COLOCATED}", nproc=1)
        assert [r["step"] for r in train_records(full)] == [1, 2, 3, 4]
        # its step-2 checkpoint resumed non-colocated: the tower decodes and encodes the clips
        # on its own rank, its rows through the bridge
        root = copy_checkpoint(tmp / "full-ckpt" / "step_0000002", tmp / "resume")
        resumed = train(ranks, tmp, "resumed", CONFIG, f"checkpoint.dir={root}", *common,
                        "layout=image=dp1,video;audio=dp1;language=dp1", nproc=3)
        # another layout sums in another order: test_train_run's cross-layout tolerances
        assert_continues(resumed, full, [3, 4], loss=1e-5, grad_norm_rel=1e-4)
        assert train_records(resumed)[-1]["loss"] != train_records(full)[1]["loss"]

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
