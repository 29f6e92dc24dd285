"""The trainer's most important property (docs/architecture.md, "One sample", step 10):
from the same weights and the same global batch, one step's loss and every parameter's gradient
agree (fp32, 1e-5) between one colocated process and each non-colocated layout, run for real under
``torchrun`` with gloo:

- fan-out: image dp1 and audio dp1 → language dp2, with images of different sizes, audio clips
  of different lengths and a text-only sample in the batch (variable per-sample token counts);
- fan-in: image dp2 → language dp1, fixed-size images (uniform counts);
- language pp2 (two pipeline stages, two micro-batches);
- fan-out with ``data.balance: tokens`` (samples rearranged between DP ranks within the step);
- fan-in of variable counts: image dp2 and audio dp2 → language dp1 (``bridge_routing``);
- ``data.packing``: one process packed against the same samples unpacked, packed fan-in with
  balance, packed language pp2 x dp2 (THD batches through the bridge and pipeline stages).

The memory settings of real sizes ride on these layouts, against the plain colocated step
(``MEMORY``): the distributed optimizer (fan-out, fan-in of variable counts, tp2), the language
model's full (fan-in of variable counts, pp2) and selective recomputation (fan-out, tp2), the
towers' (fan-out, fan-in of variable counts), sequence parallelism (language tp2 fed by image
dp2: a step of its own), the overlapped gradient reduction in buckets (fan-out) and the loss in
chunks of 97 tokens, none dividing a micro-batch's (tp2 with sequence parallelism: the
vocabulary split over the TP ranks, the sequence gathered; pp2's last stage; the packed
fan-in). Each run also shows its setting at work: each DP rank's optimizer holds its share of
the weights, a recomputed layer runs twice per micro-batch, a sequence-parallel layer norm
sees half the sequence, the reductions start from the backward pass, the output layer's own
forward never runs under the chunked loss.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import build_dataset, preprocess_config_file
from support.runs import compare, step

GLOBAL_BATCH = 4
MODEL = ["model.language.num_layers=2", "model.language.hidden_size=32",
         "model.language.num_attention_heads=2", "optimizer.warmup_steps=0", "train.steps=1",
         f"train.global_batch_size={GLOBAL_BATCH}", "train.seed=3"]
# bf16 against fp32 (8 bits of mantissa): the step's loss (relative), each module's gradient
# (relative error of the whole vector), each parameter's gradient (its cosine with fp32's: small
# gradients made of many cancelling terms, such as norm biases', lose most to bf16 rounding)
BF16_LOSS, BF16_MODULE_GRAD, BF16_COSINE = 1e-3, 0.1, 0.5


# the memory settings of real sizes (docs/training.md, "Memory at real sizes"), as overrides
MEMORY = {"distributed": ["optimizer.distributed=true"],
          "full": ["model.language.recompute=full"],
          "selective": ["model.language.recompute=selective"],
          "towers": ["model.encoders.image.recompute=full", "model.encoders.audio.recompute=full"],
          # the loss 97 tokens at a time: no micro-batch's count (a multiple of 64 unpacked)
          # is a multiple of it, so every micro-batch ends with a shorter chunk
          "chunked": ["model.language.loss_chunk_tokens=97"]}
# a module's layer and the call that runs it once per micro-batch; recomputed: twice
_RECOMPUTED = {"full": ("decoder.layers.0.mlp", "decoder"),
               "selective": ("decoder.layers.0.self_attention.core_attention", "decoder")}


def _calls(run: dict, module: str) -> dict:
    """``module``'s forward calls by submodule path (``jobs.train_parity.count_calls``), on
    the first rank holding it."""
    return next(rank["calls"][module] for rank in run["ranks"] if module in rank["calls"])


def _tower_layer(calls: dict) -> tuple[str, str]:
    """A part of an encoder module's first transformer layer (transformers recomputes the
    layer's forward, inside its hooks: its parts' hooks run again), and the tower."""
    layer = min(path for path in calls if path.endswith((".layers.0", ".blocks.0")))
    return min(path for path in calls if path.startswith(layer + ".")), layer.rsplit(".", 2)[0]


def assert_recomputed(reference: dict, run: dict, expected: dict[str, str]) -> None:
    """Each module of ``expected`` recomputes what it says (``none``: nothing), counted as
    forward calls per micro-batch, where the reference runs each layer once."""
    for module, how in expected.items():
        calls, plain = _calls(run, module), _calls(reference, module)
        if module == "language":
            pairs = [_RECOMPUTED["full"], _RECOMPUTED["selective"]]
            wanted = [2 if how == "full" else 1, 2 if how in ("full", "selective") else 1]
        else:
            pairs, wanted = [_tower_layer(calls)], [2 if how == "full" else 1]
        for (layer, once), times in zip(pairs, wanted):
            assert plain[layer][0] == plain[once][0], (module, layer, plain[layer])
            assert calls[layer][0] == times * calls[once][0], (module, how, layer,
                                                               calls[layer], calls[once])


def assert_chunked(reference: dict, run: dict) -> None:
    """The run and the reference (chunks or all at once) took their loss through
    ``mcore.language_loss``: on the language model's last stage (its final norm's ranks) the
    output layer never ran its own forward (megatron-core's path runs it on every token)."""
    for found in (reference, run):
        last = [rank["calls"]["language"] for rank in found["ranks"]
                if "decoder.final_layernorm" in rank["calls"].get("language", {})]
        assert last and all("output_layer" not in calls for calls in last), last


def assert_sharded(run: dict, dp: dict[str, int]) -> None:
    """Each module's optimizer is megatron-core's distributed one, each rank holding its
    1 / ``dp[module]`` share of the module's trained weights (DP ranks together: all)."""
    for module, size in dp.items():
        held = [rank["sharded"][module] for rank in run["ranks"] if module in rank["sharded"]]
        kinds = {kind for kind, _, _ in held}
        assert kinds == {"DistributedOptimizer"}, (module, kinds)
        assert sum(mine for _, mine, _ in held) * size == sum(whole for _, _, whole in held)
        assert all(mine < whole or size == 1 for _, mine, whole in held), (module, held)


def assert_whole_norm(run: dict, what: str) -> None:
    """The step's gradient norm, as the update clips by it (``mcore.optimizer_step``), is the
    norm of every trained parameter's whole gradient (float64 here), whatever the layout splits
    (TP shards, the distributed optimizer's): none left out or counted twice, and torch's
    float32 CPU norm of a long tensor (the 151k-row embedding's) no longer 1e-4 low."""
    every = torch.cat([grad.double().flatten() for grads in run["grads"].values()
                       for grad in grads.values()])
    assert run["grad_norm"] == pytest.approx(float(every.norm()), rel=5e-7, abs=0), what


def _reference(ranks, tmp_path: Path, layout: str, common: list[str]) -> tuple[dict, str]:
    """One colocated process; also saves the initial weights every other layout starts from."""
    init = tmp_path / "init"
    reference = step(ranks, tmp_path / "colocated", 1, f"layout={layout}",
                     f"train.micro_batch_size={GLOBAL_BATCH}", *common, save_init=init)
    return reference, str(init / "step_0000000")


def _layout(ranks, tmp_path: Path, name: str, nproc: int, layout: str, micro_batch: int,
            common: list[str], init: str | None) -> dict:
    """``init`` None: the layout draws its own weights from ``train.seed`` (in ``common``),
    which must be the reference's, whatever the layout."""
    start = [f"model.init_from={init}"] if init is not None else []
    return step(ranks, tmp_path / name, nproc, f"layout={layout}",
                f"train.micro_batch_size={micro_batch}", *start, *common)


@pytest.fixture(scope="module")
def dynamic_setup(ranks, loader_corpus, tmp_path_factory):
    """The colocated unpacked reference of the layouts on the whole corpus. seq_length 512:
    the first batch packs into two sequences of two samples, which packing reorders
    (``test_packing_reorders_the_first_batch``)."""
    tmp = tmp_path_factory.mktemp("parity-dynamic")
    preprocess = preprocess_config_file(tmp / "preprocess.yaml")
    preprocess.write_text(preprocess.read_text().replace("seq_length: 1024", "seq_length: 512"))
    common = [f"data.datasets=[{loader_corpus}]", f"data.preprocess={preprocess}",
              "model.encoders.audio.hidden_size=16", *MODEL]
    reference, init = _reference(ranks, tmp, "language=dp1;image=dp1,off0;audio=dp1,off0", common)
    return tmp, common, reference, init, preprocess


def test_first_batch_mixes_image_sizes_audio_and_text_only(dynamic_setup, loader_corpus):
    """The parity batch is the hard case: variable per-sample counts, a sample without media."""
    from mimo_data.loading.loader import build_loader

    _, _, _, _, preprocess = dynamic_setup
    loader = build_loader([loader_corpus], preprocess, "language=dp1;image=dp1,off0;"
                          "audio=dp1,off0", 0, 1, GLOBAL_BATCH, GLOBAL_BATCH, seed=3)
    _, metadata = next(iter(loader))
    loader.close()
    images = [n for counts in metadata["token_counts"]["image"] for n in counts]
    audio = [n for counts in metadata["token_counts"]["audio"] for n in counts]
    text_only = [i for i in range(GLOBAL_BATCH)
                 if not metadata["token_counts"]["image"][i]
                 and not metadata["token_counts"]["audio"][i]]
    assert len(set(images)) >= 2, images
    assert audio, "no audio clip in the parity batch"
    assert text_only, "no text-only sample in the parity batch"


def test_step_flops_are_the_batch_s(dynamic_setup, loader_corpus):
    """The step's model FLOPs (what its records get; ``compare`` checks every layout's step
    gives the same) are those of the batch's samples and media: each sample's real tokens
    (the padded batch's mask), the output layer on the trained ones (the loss mask: the only
    logits made), each image's patch grid as the tower gets it, each clip's
    window, through the formulas ``test_flops.py`` checks against hand counts."""
    from mimo_data.loading.loader import build_loader
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.planning.dims import from_plan
    from mimo_train.planning.flops import language_flops, projection_flops, tower_flops

    _, common, reference, _, preprocess = dynamic_setup
    layout = "language=dp1;image=dp1,off0;audio=dp1,off0"
    loader = build_loader([loader_corpus], preprocess, layout, 0, 1, GLOBAL_BATCH, GLOBAL_BATCH,
                          seed=3)
    batch, metadata = next(iter(loader))
    loader.close()
    rows = reference["grads"]["language"]["output_layer.weight"].shape[0]
    dims = from_plan(resolve(TrainConfig.load(None, [*common, f"layout={layout}"])),
                     tokenizer_size=rows)
    image, audio = dims.encoders["image"], dims.encoders["audio"]
    grids = batch["modality_inputs"]["image"]["image"]["image_grid_thw"].tolist()
    clips = len(batch["modality_inputs"]["audio"]["audio"]["feature_lens"])
    audio_tokens = sum(n for counts in metadata["token_counts"]["audio"] for n in counts)
    expected = {
        "language": language_flops(dims.language, batch["attention_mask"].sum(1).tolist(),
                                   trained=int(batch["loss_mask"].sum())),
        "image": tower_flops(image.tower, grids) + projection_flops(
            image.projection, sum(t * h * w for t, h, w in grids) // 4),
        "audio": tower_flops(audio.tower, [(1, *audio.tower.fixed_grid)] * clips)
        + projection_flops(audio.projection, audio_tokens)}
    assert reference["flops"] == pytest.approx(expected, rel=1e-12)


def test_fan_out_matches_colocated(ranks, dynamic_setup):
    """With the settings of real sizes: the language model's optimizer state split over its
    two DP ranks, selective recomputation of the language model, full recomputation of the
    image tower, the gradient reductions overlapped with the backward pass in buckets."""
    tmp, common, reference, init, _ = dynamic_setup
    fan_out = _layout(ranks, tmp, "fan-out", 4, "image=dp1;audio=dp1;language=dp2", 2,
                      [*common, *MEMORY["distributed"], *MEMORY["selective"],
                       "model.encoders.image.recompute=full", "optimizer.overlap_grad_reduce=true",
                       "optimizer.bucket_size=5000"], init)
    compare(reference, fan_out, "image dp1 + audio dp1 -> language dp2, distributed optimizer, "
            "selective recompute")
    assert_whole_norm(reference, "colocated")
    assert_whole_norm(fan_out, "fan-out, language dp2, distributed optimizer")
    assert_sharded(fan_out, {"image": 1, "audio": 1, "language": 2})
    assert_recomputed(reference, fan_out, {"language": "selective", "image": "full",
                                           "audio": "none"})
    # overlap_grad_reduce: buckets of 5000 elements, each reduced from the backward pass
    for run, overlapped in ((reference, False), (fan_out, True)):
        for rank in run["ranks"]:
            for module, (after, during) in rank["reductions"].items():
                assert (after == 0 < during) if overlapped else (during == 0 < after), \
                    (module, after, during)


def test_token_balanced_fan_out_matches_colocated(ranks, dynamic_setup):
    """data.balance: tokens moves samples between the language DP ranks within the step; the
    step's loss and gradients stay the colocated run's."""
    tmp, common, reference, init, _ = dynamic_setup
    balanced = _layout(ranks, tmp, "fan-out-balanced", 4, "image=dp1;audio=dp1;language=dp2", 1,
                         [*common, "data.balance=tokens"], init)
    compare(reference, balanced, "image dp1 + audio dp1 -> language dp2, balanced")


def test_language_pp2_matches_colocated(ranks, dynamic_setup):
    """With full recomputation of each stage's layers, the last stage's loss in chunks. The
    stages draw their weights from the seed, not from the reference's saved ones: a run from
    config dims must start from the same model under any pipeline split (each stage drawing
    its layers from the seed's start gave another model: step 1's loss 10.7973 against
    10.8244 in the demo's images + audio model)."""
    tmp, common, reference, _, _ = dynamic_setup
    staged = _layout(ranks, tmp, "pp2", 4, "image=dp1;audio=dp1;language=pp2", 2,
                     [*common, *MEMORY["full"], *MEMORY["chunked"]], None)
    compare(reference, staged, "language pp2, full recompute, chunked loss")
    assert_recomputed(reference, staged, {"language": "full", "image": "none", "audio": "none"})
    assert_chunked(reference, staged)


def test_fan_in_matches_colocated(ranks, corpus, tmp_path):
    """Fan-in of uniform counts: one fixed-size image in every sample (variable counts:
    ``test_fan_in_of_variable_counts_matches_colocated``)."""
    records = [dict(r, image=str(corpus / r["image"])) for r in
               json.loads((corpus / "llava.json").read_text()) if isinstance(r.get("image"), str)]
    (tmp_path / "single_image.json").write_text(json.dumps(records))
    build_dataset([tmp_path / "single_image.json"], tmp_path / "shards")
    preprocess = preprocess_config_file(tmp_path / "preprocess.yaml", image={
        "policy": "fixed", "image_size": 28, "patch_size": 14})
    common = [f"data.datasets=[{tmp_path / 'shards'}]", f"data.preprocess={preprocess}", *MODEL]
    reference, init = _reference(ranks, tmp_path, "language=dp1;image=dp1,off0", common)
    fan_in = _layout(ranks, tmp_path, "fan-in", 3, "image=dp2;language=dp1", 2, common, init)
    compare(reference, fan_in, "image dp2 -> language dp1")


def test_packing_reorders_the_first_batch(dynamic_setup, loader_corpus):
    from mimo_data.loading.loader import build_loader

    *_, preprocess = dynamic_setup
    layout = "language=dp1;image=dp1,off0;audio=dp1,off0"
    loaders = [build_loader([loader_corpus], preprocess, layout, 0, 1, GLOBAL_BATCH,
                            GLOBAL_BATCH, seed=3, packing=packing) for packing in (False, True)]
    (_, padded), (batch, packed) = (next(iter(loader)) for loader in loaders)
    assert sorted(packed["keys"]) == sorted(padded["keys"])
    assert packed["keys"] != padded["keys"]
    assert packed["sequences"] == [2, 2]
    assert batch["input_ids"].shape == (1, sum(padded["tokens"]))
    assert len({n for counts in packed["token_counts"]["image"] for n in counts}) >= 2


def test_packed_matches_unpacked(ranks, dynamic_setup):
    tmp, common, reference, init, _ = dynamic_setup
    packed = step(ranks, tmp / "packed", 1, "layout=language=dp1;image=dp1,off0;audio=dp1,off0",
                  f"train.micro_batch_size={GLOBAL_BATCH}", f"model.init_from={init}",
                  "data.packing=true", *common)
    compare(reference, packed, "one process, packed")


def test_fan_in_of_variable_counts_matches_colocated(ranks, dynamic_setup):
    """Each encoder DP rank holds one sample: images of different sizes, audio clips and
    text-only samples give every rank a different count (none, for a text-only sample).
    With the memory settings of real sizes: the distributed optimizer (each encoder's state
    split over its two DP ranks), full recomputation of the language model and of both
    towers."""
    tmp, common, reference, init, _ = dynamic_setup
    fan_in = _layout(ranks, tmp, "fan-in-variable", 5, "image=dp2;audio=dp2;language=dp1", 2,
                       [*common, *MEMORY["distributed"], *MEMORY["full"],
                        *MEMORY["towers"]], init)
    compare(reference, fan_in, "image dp2 + audio dp2 -> language dp1, distributed optimizer, "
            "full recompute")
    assert_sharded(fan_in, {"image": 2, "audio": 2, "language": 1})
    assert_recomputed(reference, fan_in, {"language": "full", "image": "full", "audio": "full"})


def test_sequence_parallel_fan_in_matches_colocated(ranks, dynamic_setup):
    """Language tp2 with sequence parallelism, selective recomputation, the distributed
    optimizer and the loss in chunks (each TP rank's half of the vocabulary, over the gathered
    sequence), fed by image dp2 and audio dp1 (fan-in): the colocated step's loss and
    gradients; the layer norms see half the sequence."""
    tmp, common, reference, init, _ = dynamic_setup
    tp2 = _layout(ranks, tmp, "tp2-sequence-parallel", 5, "image=dp2;audio=dp1;language=tp2", 2,
                  [*common, *MEMORY["distributed"], *MEMORY["selective"], *MEMORY["chunked"],
                   "model.language.sequence_parallel=true"], init)
    compare(reference, tp2, "image dp2 + audio dp1 -> language tp2, sequence parallel, "
            "chunked loss")
    assert_whole_norm(tp2, "language tp2, sequence parallel, distributed optimizer")
    assert_sharded(tp2, {"image": 2, "audio": 1, "language": 1})
    assert_recomputed(reference, tp2, {"language": "selective", "image": "none"})
    assert_chunked(reference, tp2)
    calls = _calls(tp2, "language")
    norm = calls["decoder.layers.0.input_layernorm"][1]
    attention = calls["decoder.layers.0.self_attention.core_attention"][1]
    assert 2 * norm == attention, (norm, attention)
    # these settings' third-party warnings (a core_attn recompute note for TransformerEngine,
    # CUDA stream advice on the CPU, the distributed optimizer's layout and .grad reads) are
    # known and filtered: no rank prints a warning
    for log in sorted((tmp / "tp2-sequence-parallel" / "logs").glob("rank_*.err")):
        assert "Warning" not in log.read_text() and "WARNING" not in log.read_text(), \
            log.read_text()[-3000:]


def test_packed_balanced_fan_in_matches_colocated(ranks, dynamic_setup):
    tmp, common, reference, init, _ = dynamic_setup
    fan_in = _layout(ranks, tmp, "fan-in-packed", 5, "image=dp2;audio=dp2;language=dp1", 4,
                       [*common, "data.packing=true", "data.balance=tokens",
                        *MEMORY["chunked"]], init)
    compare(reference, fan_in, "image dp2 + audio dp2 -> language dp1, packed, balanced, "
            "chunked loss")
    assert_chunked(reference, fan_in)


def test_packed_language_pp2_dp2_matches_colocated(ranks, dynamic_setup):
    tmp, common, reference, init, _ = dynamic_setup
    staged = _layout(ranks, tmp, "pp2-dp2-packed", 6, "image=dp1;audio=dp1;language=pp2,dp2", 1,
                       [*common, "data.packing=true"], init)
    compare(reference, staged, "language pp2 x dp2, packed")


def test_sdpa_matches_local_packed_or_not_with_no_host_read_in_mimo(ranks, dynamic_setup):
    """The GPU path's attention (``model.attention=sdpa``: SDPA, packed rows as one sequence
    with per-token rotary angles) against the local reference, unpacked and packed. The packed
    run then trains two steps: in the second, mimo_train's own code reads no tensor value on
    the host but for what stays on the host: the clip lengths the Whisper encoder keeps
    there, the loader's labels the loss counts its trained tokens from (``HostLabels``), the
    loss's check of that count (``_check_count``: on a GPU an assertion the host does not
    wait for; on the CPU torch reads it at once), the
    image tower's split of its items under sdpa by their boundaries, which its encoder keeps
    on the host (``FusedRotaryAttention``; under varlen they go to the kernel), the token
    ids the step keeps on the host for the splice's positions (``mcore.splice``'s
    ``Places.of``), the step before's values (``Readings.read``: copied to the host behind
    that step, so a GPU waits for that step only, not for this one's passes) and its record's
    timings and learning rates (``Metrics.flush``: host values reduced over the control
    group; every step logs, ``train.log_interval`` 1). Nor does
    megatron-core's optimizer read its gradient norm (``mcore.optimizer_step``: the
    clipping and the non-finite check on the device). The first step settled before the
    second one's update: the schedules had taken 0 steps as the first update started, 1 as
    the second did. Its ``torch.nonzero`` (a wait, when no
    host count is given) is not among them, nor are megatron-core's splice's reads
    (``MimoModel``'s text positions and counts)."""
    tmp, common, reference, init, _ = dynamic_setup
    for packing in ("false", "true"):
        reads = ["train.steps=3"] if packing == "true" else []
        other = step(ranks, tmp / f"sdpa-{packing}", 1,
                     "layout=language=dp1;image=dp1,off0;audio=dp1,off0",
                     f"train.micro_batch_size={GLOBAL_BATCH}", f"model.init_from={init}",
                     f"data.packing={packing}", "model.attention=sdpa", *common, *reads,
                     host_reads=packing == "true")
        compare(reference, other, f"one process, sdpa, packing {packing}")
    (rank,) = other["ranks"]
    ours = {site for site in rank["host_reads"] if site.startswith("mimo_train")}
    host = ("WhisperAudio.forward", "HostLabels.take", "_check_count",
            "FusedRotaryAttention.forward", "Places.of", "Readings.read", "Metrics.flush")
    assert ours and all(site.endswith(host) for site in ours), rank["host_reads"]
    assert not any("models/mimo/model/base.py" in site or "core/optimizer/" in site
                   or "models/mimo/optimizer.py" in site
                   for site in rank["host_reads"]), rank["host_reads"]
    assert any(site.endswith("HostLabels.take") for site in ours), ours
    assert any(site.endswith("Readings.read") for site in ours), ours
    assert rank["schedule_steps"] == [[0], [1]], rank["schedule_steps"]


def test_bf16_step_matches_fp32_non_colocated(ranks, dynamic_setup):
    """``train.precision=bf16`` for real, image dp1 + audio dp1 -> language dp1 on 3 ranks, from
    the reference's fp32 weights: the loss within bf16's precision of the fp32 colocated step,
    the gradients close. The weights are bf16 but for the Qwen2-VL tower's rotary frequencies,
    which stay fp32, and Whisper's position table is not trained."""
    tmp, common, reference, init, _ = dynamic_setup
    bf16 = _layout(ranks, tmp, "bf16", 3, "image=dp1;audio=dp1;language=dp1", 2,
                     [*common, "train.precision=bf16"], init)
    assert bf16["tokens"] == reference["tokens"] > 0
    loss, expected = (run["loss_sum"] / run["tokens"] for run in (bf16, reference))
    assert abs(loss - expected) <= BF16_LOSS * expected, (loss, expected)
    for module, grads in reference["grads"].items():
        assert set(bf16["grads"][module]) == set(grads), module
        ours = torch.cat([bf16["grads"][module][name].flatten() for name in grads])
        theirs = torch.cat([grad.flatten() for grad in grads.values()])
        assert (ours - theirs).norm() <= BF16_MODULE_GRAD * theirs.norm(), module
        cosines = {name: float(F.cosine_similarity(bf16["grads"][module][name].flatten(),
                                                   grad.flatten(), dim=0))
                   for name, grad in grads.items()}
        assert min(cosines.values()) >= BF16_COSINE, (module, sorted(cosines.items(),
                                                                     key=lambda kv: kv[1])[:3])
    dtypes = {module: kinds for rank in bf16["ranks"] for module, kinds in rank["dtypes"].items()}
    fixed = {module: names for rank in bf16["ranks"] for module, names in rank["fixed"].items()}
    rotary = {key for key in dtypes["image"] if key.endswith("inv_freq")}
    assert rotary and all(dtypes["image"][key] == "torch.float32" for key in rotary)
    assert {dtype for kinds in dtypes.values() for key, dtype in kinds.items()
            if key not in rotary and "position_ids" not in key} == {"torch.bfloat16"}
    assert fixed == {"image": [], "language": [],
                     "audio": ["encoders.audio.encoder.model.embed_positions.weight"]}
