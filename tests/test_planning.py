"""The layout advisor (``mimo-inspect plan --model M --gpus N``; mimo_train/planning/memory.py
and advisor.py):

- the memory formulas against a hand count (numbers written out below);
- its ranking of three layouts of one model on 4 ranks against their runs (one job of forked
  ranks, ``tests/jobs/train_runs.py``: the three runs one after another in one process group):
  the predicted order of the step times is the order of the work the runs' busiest ranks
  did, the floating-point operations torch counted in their train steps, the layouts about 2x
  apart by design (the language model's output layer over 49152 rows is the work, packed and
  balanced; language dp 1, 2 and 4). A count, not seconds: on this 2-core machine, shared
  with the other pytest worker, even the busiest rank's CPU seconds (its main thread's) move
  with the load, and the two closer layouts measured only 1.3x to 1.7x apart, a margin a
  loaded machine can cross; the counts are the same on a busy machine as on an idle one;
- the command in-process: text and ``--json`` output, layouts dropped for memory, a layout
  of the user's marked, and the options' errors (``mimo_data`` alone has no advisor);
- Qwen3.5's hybrid decoder: one gated delta-net layer's and one gated attention layer's
  parameters and activations by hand, the delta-net's against the tensors autograd saves in
  megatron-core's layer with mimo's kernels (in process, a one-rank world), the parameter
  totals of Qwen3.5-27B, Qwen3.5-35B-A3B and Qwen3.5-397B-A17B (the 27B's and 397B's
  config.json below) against transformers' own models (built on the meta device) and the
  published sizes, and the advisor's ranking of the first two on H100s;
- expert parallelism: a mixture's expert weights and optimizer state per rank under ep, etp
  and the expert data parallelism, its activations and one layer's all-to-all bytes by hand,
  the advisor's all-to-all seconds from them within a node and across two; on
  Qwen3-VL-30B-A3B's published dims (16 H100s) the advisor ranks an expert-parallel layout
  first, ahead of every layout without, and tries none for a dense model;
- LoRA adapters: per rank by hand (TP, EP, etp, PP, the distributed optimizer), Qwen3-VL-30B-
  A3B's routed-expert adapters in every ranked layout, the report and the out-of-memory
  advice, and the bytes against the trainer's own model and optimizer (in process, the
  Qwen3.5-35B-A3B replica); the Whisper, SigLIP and LLaVA towers' adapters by hand from the
  published dims (their towers on the meta device).

The measured peak memory of a real run against the prediction is tests/test_anomalies.py's
(SmolLM2-135M: weights and optimizer state dominate).

Why a job of its own: no existing job trains one model under several layouts with work large
enough for the compute to dominate the step.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from types import SimpleNamespace

import pytest
import yaml

from conftest import MODELS, PUBLISHED_TOWERS, REPO, preprocess_config_file
from mimo_data.loading.layout import Layout
from mimo_train.families.causal_lm import LinearAttention
from mimo_train.planning import memory as mem
from mimo_train.planning.dims import FULL, LINEAR, Stack

LAYOUTS = {"language dp1": "image=dp3;language=dp1", "language dp2": "image=dp2;language=dp2",
           "colocated dp4": "language=dp4;image=dp4,off0"}
BATCH, MICRO, SEED, STEPS = 12, 3, 1, 4


# ------------------------------------------------------------------------ by hand

STACK = Stack(layers=2, hidden=64, heads=4, query_groups=4, kv_channels=16, ffn_hidden=256,
              gated=False, vocab=128)


def test_parameters_and_state_bytes_by_hand():
    # a layer: qkv 64 x 192 = 12288, out 64 x 64 = 4096, MLP 64 x 256 x 2 = 32768, norms 128
    assert STACK.layer_parameters() == (49152, 128)
    # 2 layers 98560 + final norm 64 + embedding and output 128 x 64 x 2 = 16384
    assert mem.language_stage_parameters(STACK) == 115008 == STACK.parameters()
    # tp2 pp2, first stage: one layer 49152 / 2 + 128, embedding 8192 / 2
    assert mem.language_stage_parameters(STACK, tp=2, pp=2, stage=0) == 24704 + 4096
    # last stage: one layer, final norm 64, output 4096 (tied at pp2: a copy there too)
    assert mem.language_stage_parameters(STACK, tp=2, pp=2, stage=1) == 24704 + 64 + 4096
    bf16 = mem.Settings("bf16")
    assert mem.state_bytes(115008, bf16) == mem.Memory(230016, 460032, 1380096)   # 2, 4, 12
    assert mem.state_bytes(115008, mem.Settings("bf16", distributed_optimizer=True),
                           dp=4) == mem.Memory(230016, 460032, 345024)            # 12 / 4
    assert mem.state_bytes(115008, mem.Settings("fp32")).total == 115008 * 16     # 4, 4, 8
    assert mem.state_bytes(115008, bf16, trained=False) == mem.Memory(weights=230016)


def test_activation_bytes_by_hand():
    bf16 = mem.Settings("bf16")
    # one sample of 100 tokens, MHA, MLP 4h, no dropout: outside 8 h (two norms' inputs, the
    # QKV and first MLP matmuls' inputs), q, k, v, the output projection's input and a fused
    # kernel's output 10 a, the MLP 4 f: (512 + 640 + 1024) x 100
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, bf16) == 217600
    # packed rows on the varlen kernel, grouped queries (4 heads, 2 groups): q and the output
    # 4 a, the keys and values as their groups 4 g, not 10 a: (512 + 256 + 128 + 1024) x 100;
    # without grouping (4 groups) 4 a + 4 a; the local and SDPA backends as before
    grouped = dataclasses.replace(STACK, query_groups=2)
    varlen = mem.Settings("bf16", varlen_rows=True)
    assert mem.layer_activation_bytes(grouped, 100, 100 ** 2, varlen) == 192000
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, varlen) == 204800
    assert mem.layer_activation_bytes(grouped, 100, 100 ** 2, bf16) == 217600
    # tp4: a rank keeps one of the two groups whole (not half of one): q and the output
    # 4 a / 4 = 64, keys and values 4 x 16; cp4 repeats each group twice (4 to split over 4)
    assert mem.rank_groups(grouped, tp=4) == (1, 1) and mem.rank_groups(grouped, cp=4) == (2, 2)
    assert mem.layer_activation_bytes(grouped, 100, 100 ** 2, varlen, tp=4) == \
        (512 + 64 + 64 + 1024 / 4) * 100
    assert mem.layer_activation_bytes(grouped, 100, 100 ** 2, varlen, cp=4) == \
        (512 + 256 + 256 + 1024) * 100
    # the local attention keeps the scores (5 heads s^2 = 5 x 4 x 10000), not an output
    scores = mem.Settings("bf16", attention_scores=True)
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, scores) == 204800 + 200000
    # ... dropped by selective recompute
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, mem.Settings(
        "bf16", recompute="selective", attention_scores=True)) == 204800
    # tp2 with sequence parallel: everything halves; without, 8 h T stays whole
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, bf16, tp=2,
                                      sequence_parallel=True) == 108800
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, bf16, tp=2) == 51200 + 83200
    # fp32 doubles it
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, mem.Settings("fp32")) == 435200
    # the whole model: 2 layers + the hidden states' gradient 100 x 64 x 2, made with the loss
    # in the forward pass (no logits kept: megatron-core's path kept their fp32 softmax,
    # 100 x 128 x 4 = 51200)
    assert mem.language_activation_bytes(STACK, [100], bf16) == 2 * 217600 + 12800
    # full recompute: each layer's input 2 h T = 12800, plus one layer's set
    assert mem.language_activation_bytes(STACK, [100], mem.Settings(
        "bf16", recompute="full")) == 2 * 12800 + 217600 + 12800
    # 1F1B: the first of 3 stages holds 3 micro-batches of its layer (pp2: one layer)
    assert mem.in_flight(8, 3, 0) == 3 and mem.in_flight(8, 3, 2) == 1
    # ... under full recompute, 3 layer inputs and the one layer rebuilt for the backward
    # under way (one at a time), not 3 rebuilt layers
    full = mem.Settings("bf16", recompute="full")
    assert mem.language_activation_bytes(STACK, [100], full, pp=2, in_flight=3) == \
        3 * 12800 + 217600
    assert mem.language_activation_bytes(STACK, [100], bf16, pp=2, in_flight=3) == 3 * 217600
    # the advisor's window over a stage's micro-batches: what 2 in a row keep, and the
    # largest rebuilt layer once
    from mimo_train.planning.advisor.cost import _held
    assert _held([(10.0, 100.0), (30.0, 50.0), (20.0, 70.0)], 2) == 50.0 + 100.0
    assert mem.in_flight(2, 3, 0) == 2
    # temporaries at the last stage, 30 of the 100 tokens trained: the trained tokens' logits,
    # 30 x 128 x (2 + their fp32 copy 4) = 23040, then the output's weight gradient 128 x 64 x 2
    # beside the logits' bf16 gradient 30 x 128 x 2: the larger
    assert mem.language_temporary_bytes(STACK, 100, 30, bf16) == 16384 + 7680
    # fp32: the weight gradient 128 x 64 x 4 and the logits, their own fp32 copy
    assert mem.language_temporary_bytes(STACK, 100, 30, mem.Settings("fp32")) == \
        32768 + 30 * 128 * 4


def test_the_loss_in_chunks_by_hand():
    """``model.language.loss_chunk_tokens``: the last stage keeps the hidden states' gradient
    (T h w) as without chunks, and its temporaries are the forward pass's (the weight gradient
    summed in fp32 and one chunk's logits of trained tokens, each with a bf16 copy in a bf16
    run) or, where larger, the backward pass's end's (the weight gradients)."""
    bf16, fp32 = mem.Settings("bf16", loss_chunk_tokens=32), mem.Settings("fp32",
                                                                         loss_chunk_tokens=32)
    assert mem.language_activation_bytes(STACK, [100], bf16) == 2 * 217600 + 12800
    # a first stage has no output layer: nothing changes there
    assert mem.language_activation_bytes(STACK, [100], bf16, pp=2) == \
        mem.language_activation_bytes(STACK, [100], mem.Settings("bf16"), pp=2) == 217600
    # all 100 trained, bf16: the weight gradient summed in fp32 128 x 64 x 4 + a chunk's
    # logits 32 x 128 x (4 + 2), over its cast to bf16 at the end 128 x 64 x (4 + 2) and the
    # weight gradient at the backward's end 128 x 64 x 2
    assert mem.language_temporary_bytes(STACK, 100, 100, bf16) == 8192 * 4 + 4096 * 6 == 57344
    # fp32: the logits are their own fp32 copy: x 4
    assert mem.language_temporary_bytes(STACK, 100, 100, fp32) == (8192 + 4096) * 4
    # a chunk of 4 tokens: the cast at the end is the larger
    assert mem.language_temporary_bytes(STACK, 100, 100, mem.Settings(
        "bf16", loss_chunk_tokens=4)) == 8192 * 6
    # a chunk longer than the trained tokens is all of them, its weight gradient made in
    # bf16 (128 x 64 x 2) from the logits' bf16 gradient, not summed in fp32: the logits with
    # their fp32 copy, 12800 x 6, are the larger; 30 trained tokens in chunks of 32 likewise,
    # the weight gradient beside 30 x 128 x 2 the larger
    assert mem.language_temporary_bytes(STACK, 100, 100, mem.Settings(
        "bf16", loss_chunk_tokens=4096)) == 12800 * 6
    assert mem.language_temporary_bytes(STACK, 100, 30, bf16) == 16384 + 30 * 128 * 2
    # tp2: half the rows of each
    assert mem.language_temporary_bytes(STACK, 100, 100, bf16, tp=2) == 4096 * 4 + 2048 * 6
    # cp4: a rank's 25 positions hold at most 25 of the 80 trained tokens
    assert mem.language_temporary_bytes(STACK, 100, 80, bf16, cp=4) == \
        mem.language_temporary_bytes(STACK, 25, 25, bf16)
    # tied at pp1 in fp32: the two weight gradients at the backward's end, 2 x 128 x 64 x 4,
    # are the larger
    tied = dataclasses.replace(STACK, tied=True)
    assert mem.language_temporary_bytes(tied, 100, 100, fp32) == 2 * 32768


def test_a_tower_under_selective_recompute_keeps_everything():
    """A transformers tower has no selective recompute: under the run's ``selective`` it
    keeps what it keeps under ``none``; it keeps no scores whatever the language model's
    kernel (transformers' towers run fused ones)."""
    from mimo_train.planning.dims import Tower
    tower = Tower("siglip", STACK, (), 64)
    grids = [(1, 10, 10)]
    kept = {r: mem.tower_activation_bytes(tower, grids, mem.Settings(
        "bf16", recompute=r, attention_scores=True)) for r in mem.RECOMPUTE}
    assert kept["selective"] == kept["none"] > kept["full"]
    # 2 layers of 100 positions, no scores (as by hand above)
    assert kept["none"] == 2 * 217600
    # the tower's own recompute, the language model's none (model.encoders.<m>.recompute)
    alone = mem.tower_activation_bytes(tower, grids, mem.Settings(
        "bf16", attention_scores=True, tower_recompute="full"))
    assert alone == kept["full"]
    assert mem.tower_activation_bytes(tower, grids, mem.Settings(
        "bf16", recompute="full", attention_scores=True, tower_recompute="none")) == kept["none"]


# ---------------------------------------------------------- expert parallelism, by hand

# a mixture of experts: 8 experts of 32 (SwiGLU), 2 a token, no shared expert
MOE = Stack(layers=2, hidden=64, heads=4, query_groups=4, kv_channels=16, ffn_hidden=32,
            gated=True, vocab=128, experts=8, experts_per_token=2)


def test_expert_parameters_and_state_by_hand():
    # a layer: qkv 64 x 192 = 12288, out 64 x 64 = 4096, router 64 x 8 = 512; each expert
    # gate and up 64 x 64 = 4096, down 32 x 64 = 2048: 8 x 6144 = 49152; norms 128
    assert MOE.layer_parameters() == (12288 + 4096 + 512 + 49152, 128)
    assert MOE.layer_expert_parameters() == 49152
    # tp2 ep4 etp1: the dense matmuls 16896 / 2 + norms 128 per layer, 2 layers: 17152; the
    # experts 2 x 49152 / 4 (2 whole experts a layer): 24576; embedding and output 128 x 64 /
    # 2 each, final norm 64
    assert mem.language_stage_expert_parameters(MOE, ep=4, etp=1) == 24576
    assert mem.language_stage_parameters(MOE, tp=2, ep=4, etp=1) == \
        17152 + 24576 + 4096 + 64 + 4096
    # etp defaults to tp: each of the 2 experts a rank holds split in 2: 12288
    assert mem.language_stage_parameters(MOE, tp=2, ep=4) == 17152 + 12288 + 8256
    # without expert parallelism the experts split over tp as a dense MLP: 49152 a rank
    assert mem.language_stage_parameters(MOE, tp=2) == 17152 + 49152 + 8256
    # the distributed optimizer, tp2 dp4 ep4 etp1: expert dp = 2 x 4 / (1 x 4) = 2. The dense
    # 25408 parameters: weights 2, grads 4, Adam 12 / dp 4 = 3 bytes each; the experts' 24576:
    # 2, 4 and 12 / 2 = 6
    dist = mem.Settings("bf16", distributed_optimizer=True)
    assert mem.language_state_bytes(MOE, dist, tp=2, dp=4, ep=4, etp=1) == mem.Memory(
        2 * 49984, 4 * 49984, 3 * 25408 + 6 * 24576)
    # ep2 (etp 2): 2 x 49152 / 4 = 24576 expert weights again, expert dp 8 / 4 = 2
    assert mem.language_state_bytes(MOE, dist, tp=2, dp=4, ep=2) == mem.Memory(
        2 * 49984, 4 * 49984, 3 * 25408 + 6 * 24576)
    # the experts' Adam state is 12 x 98304 / (tp x dp) = 147456 bytes whatever ep: ep8 etp1
    # (expert dp 1) holds 12288 expert weights and all their state
    assert mem.language_state_bytes(MOE, dist, tp=2, dp=4, ep=8, etp=1).optimizer == \
        3 * 25408 + 12 * 12288 == 3 * 25408 + 147456
    # no distributed optimizer: 18 bytes each, whatever the expert layout
    assert mem.language_state_bytes(MOE, mem.Settings("bf16"), tp=2, dp=4, ep=4,
                                    etp=1).total == 18 * 49984


def test_expert_activations_by_hand():
    bf16 = mem.Settings("bf16")
    # 100 tokens, tp2 with sequence parallel: 10 h T / 2 = 32000 outside; inside, ÷ 2: q and
    # the output projection's input 4 x 64, k and v 4 x 64, the experts' 6 x 32 x 2 = 384 and
    # the dispatcher's copies 2 h k (etp + 1): at etp 1, 2 x 64 x 2 x 2 = 512
    assert mem.layer_activation_bytes(MOE, 100, 100 ** 2, bf16, tp=2, sequence_parallel=True,
                                      etp=1) == 32000 + (512 + 384 + 512) * 50
    # ep4: the busiest rank gets 1.1 x its share of the routed tokens
    assert mem.layer_activation_bytes(MOE, 100, 100 ** 2, bf16, tp=2, sequence_parallel=True,
                                      ep=4, etp=1) == \
        pytest.approx(32000 + (512 + 1.1 * (384 + 512)) * 50)
    # etp 2 (the default at tp2): the copy into the experts gathered over 2 ranks, 2 x 64 x 2
    # x 3 = 768
    assert mem.layer_activation_bytes(MOE, 100, 100 ** 2, bf16, tp=2,
                                      sequence_parallel=True) == 32000 + (512 + 384 + 768) * 50


def test_all_to_all_of_one_layer_by_hand():
    """Bytes a rank sends per layer and micro-batch (forward and backward), and the advisor's
    all-to-all seconds of a step from them, over a node's links or the network's."""
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, Model, Work
    from mimo_train.planning.advisor.cost import layer_traffic
    from mimo_train.planning.dims import ModelDims
    # a micro-batch of 100 positions in bf16: hidden states 100 x 64 x 2 = 12800 bytes. tp2
    # ep4 etp1: the attention's 2 all-reduces, 2 x 1/2 x 12800 each: 25600 (no shared expert:
    # the MLP's none), no gather; a rank's own 50 tokens x k 2 x 64 x 2 = 12800 bytes routed,
    # 3/4 of it leaving, x 1.1 on the busiest rank, 4 all-to-alls: 42240
    tp_bytes, exchange = layer_traffic(MOE, 100, 2, tp=2, ep=4, etp=1)
    assert tp_bytes == 25600 and exchange == pytest.approx(4 * 3 / 4 * 12800 * 1.1)
    assert exchange == pytest.approx(42240)
    # ep2 etp2: the dispatcher's gather forward and scatter backward over 2 ranks of the
    # 12800 x 1.1 bytes a rank got (the other rank's half of each 2 x 12800 x 1.1), and the
    # reverse of each: 4 x 14080 = 56320 more over TP; the all-to-alls 4 x 1/2 x 14080
    tp_bytes, exchange = layer_traffic(MOE, 100, 2, tp=2, ep=2)
    assert tp_bytes == pytest.approx(25600 + 56320) and exchange == pytest.approx(28160)
    # no expert parallelism: no all-to-all
    assert layer_traffic(MOE, 100, 2, tp=2)[1] == 0
    assert layer_traffic(STACK, 100, 2, tp=2) == (4 * 2 * 1 / 2 * 100 * 64 * 2, 0.0)
    # the advisor on 8 packed samples of 100 tokens, micro-batches of 1, language tp2 dp4: 2
    # micro-batches a DP rank, 2 layers each: 4 x 42240 bytes over 300 GB/s when each
    # expert-parallel group (4 ranks in a row at etp1) lies in a node of 4 GPUs
    model = Model(ModelDims(MOE), "moe", "bf16")
    work = Work([[100] * 8], [[100] * 8], {}, {}, 1, 8, 128, True)
    advisor = Advisor(model, work, GPU("gpu", 80.0, 1000.0, 300.0, 40.0, per_node=4))
    settings = mem.Settings("bf16", distributed_optimizer=True, sequence_parallel=True)
    within = advisor.evaluate(Candidate(Layout.parse("language=tp2,dp4,ep4,etp1"), settings))
    assert within.all_to_all == pytest.approx(4 * 42240 / 300e9)
    # ep8 etp1: one group of all 8 ranks, over two nodes: 7/8 of the routed tokens leave, at
    # the network's 40 GB/s
    across = advisor.evaluate(Candidate(Layout.parse("language=tp2,dp4,ep8,etp1"), settings))
    assert across.all_to_all == pytest.approx(4 * 4 * 7 / 8 * 12800 * 1.1 / 40e9)
    dense = advisor.evaluate(Candidate(Layout.parse("language=tp2,dp4"), settings))
    assert dense.all_to_all == 0 and across.step_s > within.step_s
    # a tensor-parallel group across two nodes of 4 (the language model from rank 2, tp4):
    # the network's bandwidth; from rank 4, within a node
    straddling = Layout.parse("image=dp2;language=tp4").module("language")
    aligned = Layout.parse("image=dp4;language=tp4").module("language")
    assert (advisor._tp_gbs(straddling), advisor._tp_gbs(aligned)) == (40.0, 300.0)


def test_the_balancing_loss_s_counting_pass_is_one_more_forward_of_every_module():
    """With ``model.language.moe_aux_loss`` each step runs its micro-batches forward once
    more (``mcore.balance``'s counting pass): the advisor's compute time is (passes + 1) /
    passes of its own, a frozen module's doubled."""
    from mimo_train.plan import rules
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, Model, Work
    from mimo_train.planning.dims import ModelDims
    work = Work([[100] * 8], [[100] * 8], {}, {}, 1, 8, 128, True)
    slow = GPU("cpu", 1e3, 0.02, 1e3, 1e3)          # compute is all of a step's time

    def busy(aux: float, passes: int = 3) -> float:
        model = Model(ModelDims(MOE), "moe", "bf16", passes={"language": passes},
                      rule_settings=rules.Settings(moe_aux_loss=aux))
        return Advisor(model, work, slow).evaluate(Candidate(
            Layout.parse("language=dp8"), mem.Settings("bf16"))).busy["language"]
    assert busy(0.01) / busy(0.0) == pytest.approx(4 / 3, rel=1e-3)
    assert busy(0.01, passes=1) / busy(0.0, passes=1) == pytest.approx(2, rel=1e-3)


# ------------------------------------------------------------------- the model, the data

@pytest.fixture(scope="module")
def model_yaml(loader_corpus, tmp_path_factory):
    """A small image + language model whose language output layer (49152 rows) is most of
    the work, its preprocessing (images only: samples with audio are dropped)."""
    tmp = tmp_path_factory.mktemp("planning")
    base = yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())
    # at most 16 tokens per image: the images' decoding, on the image ranks, stays small
    preprocess = preprocess_config_file(tmp / "preprocess.yaml", image={
        **base["modalities"]["image"], "max_pixels": 12544})
    config = {"data": {"datasets": [str(loader_corpus)], "preprocess": str(preprocess),
                       "packing": True, "balance": "tokens", "num_workers": 1},
              "layout": LAYOUTS["language dp1"],
              "model": {"language": {"num_layers": 1, "hidden_size": 64,
                                     "num_attention_heads": 2},
                        "encoders": {"image": {"hidden_size": 32, "num_layers": 1,
                                               "num_attention_heads": 2}}},
              "optimizer": {"warmup_steps": 0},
              "train": {"global_batch_size": BATCH, "micro_batch_size": MICRO, "steps": STEPS,
                        "seed": SEED, "device": "cpu", "log_interval": STEPS},
              "checkpoint": {"dir": None}}
    path = tmp / "model.yaml"
    path.write_text(yaml.safe_dump(config))
    return tmp, path, preprocess


def _args(**changes) -> SimpleNamespace:
    values = dict(gpus=4, gpu="h100", gpu_memory_gib=None, gpu_tflops=None, mfu=None,
                  precision=None, distributed_optimizer="both", recompute="any",
                  no_sequence_parallel=False, top=5, layout=None)
    return SimpleNamespace(**{**values, **changes})


def _run(capsys, main, *args) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``main`` in-process."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _plan(capsys, loader_corpus, preprocess, model, *extra, main) -> tuple[int, str, str]:
    return _run(capsys, main, "plan", loader_corpus, "--config", preprocess, "--model", model,
                "--global-batch-size", BATCH, "--micro-batch-size", MICRO, *extra)


# --------------------------------------------------------------------- the measured ranking

@pytest.fixture(scope="module")
def measured(ranks, model_yaml):
    tmp, path, _ = model_yaml
    runs = [{"name": name, "config": str(path), "overrides": [f"layout={layout}"],
             "count_flops": True} for name, layout in LAYOUTS.items()]
    (tmp / "runs.json").write_text(json.dumps(runs))
    ranks.run(4, [REPO / "tests" / "jobs" / "train_runs.py", tmp / "runs.json",
                  tmp / "out.json"], tmp / "logs", timeout=900).check()
    return json.loads((tmp / "out.json").read_text())


def test_the_predicted_order_of_three_layouts_is_the_measured_one(measured, model_yaml):
    """The advisor's step times of the three layouts (fp32, the runs' settings) are ordered as
    the work of the runs' busiest ranks, the FLOPs torch counted in their train steps (the
    language model's share of each micro-batch on its DP rank, the tower's beside it on a
    colocated rank): predicted 1.7x to 1.9x apart, counted about 2x, each pair held to 1.5x.
    The busiest ranks' CPU seconds per step (the least of steps 2 to 4) are in the messages
    only: they order the same way on an idle machine, but the closer pair measured 1.3x to
    1.7x apart, which load can undo."""
    from mimo_data.inspect.workload import workload
    from mimo_data.loading.loader import DataSource
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, read_model, read_work
    _, path, preprocess = model_yaml
    config = PreprocessConfig.from_yaml(preprocess)
    work = workload(DataSource([str(yaml.safe_load(path.read_text())["data"]["datasets"][0])],
                               config), config, BATCH, MICRO, seed=SEED, steps=STEPS)
    model = read_model(str(path), str(preprocess), config, work["modalities"])
    assert model.precision == "fp32"
    advisor = Advisor(model, read_work(model, work), GPU("cpu", 1e3, 0.02, 1e3, 1e3))
    predicted = {name: advisor.evaluate(Candidate(Layout.parse(layout), mem.Settings("fp32")))
                 for name, layout in LAYOUTS.items()}
    assert all(len(run["records"]) == STEPS for run in measured.values())
    # the busiest rank's FLOPs over the run's steps
    flops = {name: max(sum(steps) for steps in run["step_flops"])
             for name, run in measured.items()}
    order = sorted(LAYOUTS, key=lambda name: predicted[name].step_s)
    cpu_s = {name: max(min(steps[1:]) for steps in run["step_cpu_s"])
             for name, run in measured.items()}
    assert order == sorted(LAYOUTS, key=lambda name: flops[name]), (
        {n: r.step_s for n, r in predicted.items()}, flops, cpu_s)
    for slower, faster in zip(order[1:], order):
        assert predicted[slower].step_s > 1.5 * predicted[faster].step_s
        assert flops[slower] > 1.5 * flops[faster], (flops, cpu_s)
    assert order == ["colocated dp4", "language dp2", "language dp1"]
    assert predicted["language dp1"].bottleneck == "language"


def test_model_flops_count_the_passes_the_trainer_counts(model_yaml):
    """A frozen language model after a trained tower runs 2 passes (input gradients only):
    the advisor's model FLOPs (its MFU) count 2, as the trainer's FlopsCounter does
    (``flops.training_passes``), not 3; its own weights keep no gradients."""
    from mimo_data.inspect.workload import workload
    from mimo_data.loading.loader import DataSource
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, read_model, read_work
    from mimo_train.planning.flops import language_flops
    tmp, path, preprocess = model_yaml
    config = yaml.safe_load(path.read_text())
    config["model"]["freeze"] = ["language"]
    frozen = tmp / "model-frozen-language.yaml"
    frozen.write_text(yaml.safe_dump(config))
    preprocessing = PreprocessConfig.from_yaml(preprocess)
    work = workload(DataSource([str(config["data"]["datasets"][0])], preprocessing),
                    preprocessing, BATCH, MICRO, seed=SEED, steps=2)
    model = read_model(str(frozen), str(preprocess), preprocessing, work["modalities"])
    assert model.passes["language"] == 2 and model.passes["image.encoder"] == 3
    assert model.trained == {"language": False, "image.encoder": True,
                             "image.projection": True}
    steps = read_work(model, work)
    result = Advisor(model, steps, GPU("cpu", 1e3, 0.02, 1e3, 1e3)).evaluate(
        Candidate(Layout.parse(LAYOUTS["language dp1"]), mem.Settings("fp32")))
    language = sum(language_flops(model.dims.language, lengths, 2, sum(trained))
                   for lengths, trained in zip(steps.lengths, steps.trained)) / len(steps.lengths)
    encoders = sum(map(sum, steps.encoder_flops["image"])) / len(steps.lengths)
    assert language > 0 and result.flops == pytest.approx(language + encoders)


def test_the_advisor_counts_a_config_s_loss_in_chunks(model_yaml):
    """A training YAML's ``model.language.loss_chunk_tokens`` reaches every setting the
    advisor tries, and its language rank's predicted memory then holds one chunk's logits
    (of 49152 rows) in place of those of the micro-batch's trained tokens."""
    from mimo_data.inspect.advice import AdvisorRequest
    from mimo_data.inspect.workload import workload
    from mimo_data.loading.loader import DataSource
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, read_model, read_work
    from mimo_train.planning.advisor.candidates import settings_of
    tmp, path, preprocess = model_yaml
    config = yaml.safe_load(path.read_text())
    config["model"]["language"]["loss_chunk_tokens"] = 16
    chunked = tmp / "model-chunked-loss.yaml"
    chunked.write_text(yaml.safe_dump(config))
    preprocessing = PreprocessConfig.from_yaml(preprocess)
    work = workload(DataSource([str(config["data"]["datasets"][0])], preprocessing),
                    preprocessing, BATCH, MICRO, seed=SEED, steps=2)
    layout = Layout.parse(LAYOUTS["language dp1"])
    memory = {}
    for yaml_path in (path, chunked):
        model = read_model(str(yaml_path), str(preprocess), preprocessing, work["modalities"])
        tried = settings_of(model, layout, AdvisorRequest(str(yaml_path), str(preprocess), 4))
        assert tried and {s.loss_chunk_tokens for s in tried} == {model.loss_chunk_tokens}
        memory[model.loss_chunk_tokens] = Advisor(
            model, read_work(model, work), GPU("cpu", 1e3, 0.02, 1e3, 1e3)).evaluate(
            Candidate(layout, tried[0])).memory["language"]
    assert set(memory) == {0, 16}
    assert memory[16].weights == memory[0].weights
    assert memory[16].activations == memory[0].activations       # the hidden states' gradient
    assert memory[16].temporary < memory[0].temporary
    assert memory[16].total < memory[0].total
    # the kernel the run's attention gets: varlen with model.attention auto in bf16 (the
    # towers', and with packing the language model's rows), SDPA in fp32
    for precision, attention, varlen in (("bf16", "auto", True), ("fp32", "auto", False),
                                         ("fp32", "varlen", True), ("bf16", "sdpa", False)):
        config["train"] = {**config.get("train", {}), "precision": precision}
        config["model"]["attention"] = attention
        chunked.write_text(yaml.safe_dump(config))
        model = read_model(str(chunked), str(preprocess), preprocessing, work["modalities"])
        for packing in (False, True):
            tried = settings_of(model, layout, AdvisorRequest(str(chunked), str(preprocess), 4),
                                packing)
            assert {(s.tower_varlen, s.varlen_rows) for s in tried} == {
                (varlen, varlen and packing)}, (precision, attention, packing)


# ------------------------------------------------------------------------------ the command

def test_plan_ranks_layouts_that_fit(capsys, loader_corpus, model_yaml):
    from mimo_train.inspect_cli import main
    _, path, preprocess = model_yaml
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                           "--layout", LAYOUTS["language dp2"], main=main)
    assert code == 0, err
    report = json.loads(out)
    ranked = report["ranked"]
    assert report["layouts"] >= 3 and report["fitting_layouts"] == report["layouts"]
    times = [r["step_s"] for r in ranked if r["rank"] <= 5]
    assert times == sorted(times) and len(times) == min(5, report["fitting_layouts"])
    assert all(r["fits"] and r["peak_memory_gib"] <= report["gpu"]["usable_gib"]
               for r in ranked)
    assert report["yours"] == LAYOUTS["language dp2"]
    assert LAYOUTS["language dp2"] in [r["layout"] for r in ranked]
    assert all(set(r["memory_gib"]) and r["bottleneck"] and 0 <= r["idle_fraction"] < 1
               for r in ranked)
    assert report["model"]["precision"] == "fp32"
    # each comes with the overrides that train it, which the training config takes (its
    # precision the YAML's: not overridden)
    from mimo_train.config import TrainConfig
    for r in ranked:
        cfg = TrainConfig.load(str(path), r["overrides"])
        assert Layout.parse(cfg.layout).colocated == r["colocated"]
        assert cfg.optimizer.distributed == r["settings"]["distributed_optimizer"]
        assert cfg.model.language.recompute == r["settings"]["recompute"]
        assert not any(o.startswith("train.precision=") for o in r["overrides"]), r
    # yours in another module order than the advisor's costs the same: shown once, as yours,
    # where the advisor's was
    swapped = "language=dp2;image=dp2"
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                           "--top", 50, "--layout", swapped, main=main)
    order = [r["layout"] for r in json.loads(out)["ranked"]]
    assert LAYOUTS["language dp2"] not in order, order
    assert order == [swapped if layout == LAYOUTS["language dp2"] else layout
                     for layout in [r["layout"] for r in ranked]], order
    # the text form: the table and the reasons, the user's layout marked
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--layout",
                           LAYOUTS["language dp2"], main=main)
    assert code == 0, err
    assert "<- yours" in out and "why" in out and "bottleneck" in out
    # yours ranked below the top shown: after them (and the other language layouts), under
    # its own label, not as if it were next in rank
    last = ranked[-1]["layout"]
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--top", 1,
                           "--layout", last, main=main)
    table = out.split("layout  (settings)\n")[1].split("\nwhy\n")[0].splitlines()
    assert code == 0 and table[0].startswith("   1 ") and table[-2] == "yours:" and \
        table[-1].startswith(f"{len(ranked):4d} ") and table[-1].endswith("<- yours"), out
    # without --layout, the YAML's own layout is the one marked
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, main=main)
    assert code == 0, err
    yours = [line for line in out.splitlines() if line.endswith("<- yours")]
    assert len(yours) == 1 and f"  {LAYOUTS['language dp1']}  (" in yours[0], out
    # the command starts as many ranks as the first layout holds (not a lone mimo-train),
    # with the training YAML given as --model
    first = re.search(r"\n  1\. (\S+):", out).group(1)
    assert (f"train the first with: torchrun --nproc-per-node "
            f"{Layout.parse(first).world_size} -m mimo_train --config {path} 'layout=") in out
    # advice in another precision than the YAML's (fp32): the command trains in that one
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--precision",
                           "bf16", main=main)
    launch = next(line for line in out.splitlines() if line.startswith("train the first"))
    assert code == 0 and "model     " in out and ", bf16\n" in out, err
    assert launch.endswith(" train.precision=bf16"), launch
    overrides = shlex.split(launch.split(f"--config {path} ")[1])
    assert TrainConfig.load(str(path), overrides).train.precision == "bf16"
    from mimo_train.planning.advisor.report import _launch
    assert _launch(16, 8, "--config x") == ("torchrun --nnodes 2 --nproc-per-node 8 -m "
                                            "mimo_train --config x")
    assert _launch(8, 4, "x") == "torchrun --nnodes 2 --nproc-per-node 4 -m mimo_train x"
    # ranks that do not fill the last node: the nodes the cost model placed them in (8 + 4,
    # not 6 + 6, whose tp4 groups at ranks 4-7 would straddle two nodes)
    assert _launch(12, 8, "x").startswith("torchrun --nnodes 2 --nproc-per-node 8 -m "
                                          "mimo_train x  # 12 ranks: 8 on each node but the "
                                          "last, --nproc-per-node 4 there")
    assert out.count("\n  1. ") == 1


def test_plan_settings_are_ones_the_trainer_takes(capsys, loader_corpus, model_yaml):
    """Packed data (the YAML's data.packing: true, no --packing given): no candidate takes
    sequence parallel, which the trainer refuses with packing; unpacked, those with tp > 1
    do. Each recommendation's overrides, on a YAML whose optimizer.modules.image sets its
    own ``distributed``, give every module the recommended distributed optimizer and the
    recommended sequence parallel, and the trainer's memory settings accept them."""
    from mimo_train.config import TrainConfig
    from mimo_train.inspect_cli import main
    from mimo_train.plan import resolve
    tmp, path, preprocess = model_yaml
    for packing in (True, False):
        config = yaml.safe_load(path.read_text())
        config["data"]["packing"] = packing
        config["optimizer"]["modules"] = {"image": {"distributed": not packing}}
        variant = tmp / f"model-packing-{packing}.yaml"
        variant.write_text(yaml.safe_dump(config))
        # 5 GPUs: image=dp3;language=tp2 is a layout (the micro-batches of 3 split in 3)
        code, out, err = _plan(capsys, loader_corpus, preprocess, variant, "--gpus", 5,
                               "--json", "--top", 50, main=main)
        assert code == 0, err
        report = json.loads(out)
        assert report["workload"]["packing"] is packing
        ranked = report["ranked"]
        assert any(Layout.parse(r["layout"]).language.tp > 1 for r in ranked)
        for r in ranked:
            tp = Layout.parse(r["layout"]).language.tp
            assert r["settings"]["sequence_parallel"] is (tp > 1 and not packing)
            cfg = TrainConfig.load(str(variant), r["overrides"])
            assert cfg.model.language.sequence_parallel is r["settings"]["sequence_parallel"]
            for module in ("language", "image"):
                assert cfg.optimizer.of(module).distributed is \
                    r["settings"]["distributed_optimizer"]
            resolve(cfg)                # the trainer's start-up: raises what it refuses
    # the start-up line's memory settings: a module that trains nothing says so, not the
    # optimizer settings that hold nothing for it
    frozen = resolve(TrainConfig.load(str(path), ["model.freeze=[image]", "layout=image=dp2;"
                                                  "language=dp2", "optimizer.distributed=true"]))
    assert frozen.memory_summary().split("; ") == ["image: frozen",
                                                   "language: distributed optimizer"]
    # over one rank of dp x cp it shards nothing: said, not left to read as sharded
    alone = resolve(TrainConfig.load(str(path), ["model.freeze=[image]", "layout=image=dp1;"
                                                 "language=dp1", "optimizer.distributed=true"]))
    assert alone.memory_summary().split("; ") == [
        "image: frozen", "language: distributed optimizer (dp x cp 1: nothing to shard)"]
    # --packing against the YAML's data.packing: false
    code, _, err = _plan(capsys, loader_corpus, preprocess, variant, "--gpus", 4, "--packing",
                         main=main)
    assert code == 2 and "data.packing: false" in err
    # --config other than the YAML's data.preprocess: the plan would count another
    # preprocessing than the run's, refused in both forms before any planning
    other = tmp / "other-preprocess.yaml"
    changed = yaml.safe_load(preprocess.read_text())
    changed["seq_length"] = changed.get("seq_length", 1024) // 2
    other.write_text(yaml.safe_dump(changed))
    for form in (("--gpus", 4), ("--layout", LAYOUTS["language dp1"])):
        code, _, err = _plan(capsys, loader_corpus, other, variant, *form, main=main)
        assert code == 2 and f"its data.preprocess is {preprocess}" in err and \
            f"give --config {preprocess}" in err, err
    # a copy (comments aside) is the same preprocessing: planned
    other.write_text("# a copy\n" + preprocess.read_text())
    code, given, err = _plan(capsys, loader_corpus, other, variant, "--layout",
                             LAYOUTS["language dp1"], "--seed", SEED, main=main)
    assert code == 0, err
    # the YAML's batch sizes, seed and balance are the plan's where no option gives them (the
    # seed was 0, the trainer's default 1: the plan drew other samples than the run)
    code, taken, err = _run(capsys, main, "plan", loader_corpus, "--config", preprocess,
                            "--model", variant, "--layout", LAYOUTS["language dp1"])
    assert code == 0 and taken == given, err
    # without --config: the YAML's own data.preprocess; a YAML without one, or no YAML, asks
    # for --config
    code, own, err = _run(capsys, main, "plan", loader_corpus, "--model", variant, "--layout",
                          LAYOUTS["language dp1"])
    assert code == 0 and own == given and "note" not in err, err
    # the advisor's figures for this layout are one option away: its 4 GPUs named
    assert own.splitlines()[-1] == ("memory    per rank and step time for --model: add --gpus 4 "
                                    "(the advisor figures this layout and ranks it among the "
                                    "others of 4 GPUs)"), own
    # a YAML that trains a mix: the plan is DIR's alone, said
    mix = yaml.safe_load(variant.read_text())
    mix["data"].update(datasets=[str(loader_corpus), "other"], weights=[1, 3])
    (tmp / "mix.yaml").write_text(yaml.safe_dump(mix))
    code, alone, err = _run(capsys, main, "plan", loader_corpus, "--model", tmp / "mix.yaml",
                            "--layout", LAYOUTS["language dp1"])
    assert code == 0 and alone == given, err
    assert err == (f"mimo-inspect plan: note: --model {tmp / 'mix.yaml'} trains data.datasets "
                   f"{loader_corpus}, {tmp / 'other'} with data.weights 1, 3; this "
                   f"plan counts {loader_corpus} alone (`python -m mimo_data.loading.dry_run` "
                   "plans the mix: its --weights, --balance and --packing as the run's)\n")
    # batch sizes taken from the YAML are named as its keys, not as options not given
    uneven = yaml.safe_load(variant.read_text())
    uneven["train"].update(global_batch_size=8, micro_batch_size=3)
    (tmp / "uneven.yaml").write_text(yaml.safe_dump(uneven))
    code, _, err = _run(capsys, main, "plan", loader_corpus, "--model", tmp / "uneven.yaml",
                        "--layout", LAYOUTS["language dp1"])
    assert code == 2 and "error: train.global_batch_size 8 is not a whole number of " \
        "micro-batches of train.micro_batch_size 3 (from --model " in err, err
    unset = yaml.safe_load(variant.read_text())
    unset["data"]["preprocess"] = "nowhere.yaml"              # a file that is not there
    (tmp / "unset.yaml").write_text(yaml.safe_dump(unset))
    code, _, err = _run(capsys, main, "plan", loader_corpus, "--model", tmp / "unset.yaml",
                        "--layout", LAYOUTS["language dp1"])
    assert code == 2 and err == (f"mimo-inspect plan: error: --model {tmp / 'unset.yaml'}'s "
                                 f"data.preprocess {tmp / 'nowhere.yaml'} is not a file: fix "
                                 "the YAML, or give --config CFG\n"), err
    unset["data"]["preprocess"] = str(preprocess)
    unset["data"]["datasets"] = ["s3:/bucket/ds"]            # a URL missing a slash
    (tmp / "unset.yaml").write_text(yaml.safe_dump(unset))
    for with_config in ([], ["--config", preprocess]):
        code, _, err = _run(capsys, main, "plan", loader_corpus, "--model", tmp / "unset.yaml",
                            *with_config, "--layout", LAYOUTS["language dp1"])
        assert code == 2 and err.startswith(
            f"mimo-inspect plan: error: --model {tmp / 'unset.yaml'}: data.datasets: "
            "s3:/bucket/ds is a URL with one slash"), err
    del unset["data"]["preprocess"]
    unset["data"]["datasets"] = [str(loader_corpus)]
    (tmp / "unset.yaml").write_text(yaml.safe_dump(unset))
    for model, said in ((["--model", tmp / "unset.yaml"],
                         f"(--model {tmp / 'unset.yaml'} sets no data.preprocess)"),
                        ([], "(it may be left out only with --model TRAIN.yaml: its "
                         "data.preprocess)")):
        code, _, err = _run(capsys, main, "plan", loader_corpus, *model, "--layout",
                            LAYOUTS["language dp1"])
        assert code == 2 and err == f"mimo-inspect plan: error: --config CFG is required {said}\n"
    # (its own layout, a file given relative to where the run starts, is not read: --layout
    # is the plan's)
    elsewhere = yaml.safe_load(variant.read_text())
    elsewhere["layout"] = "layouts/mine.yaml"
    (tmp / "layout-elsewhere.yaml").write_text(yaml.safe_dump(elsewhere))
    code, taken, err = _run(capsys, main, "plan", loader_corpus, "--config", preprocess,
                            "--model", tmp / "layout-elsewhere.yaml", "--layout",
                            LAYOUTS["language dp1"])
    assert code == 0 and taken == given, err
    for option, value, key in (("--micro-batch-size", 1, f"train.micro_batch_size {MICRO}"),
                               ("--seed", SEED + 1, f"train.seed {SEED}"),
                               ("--balance", "none", "data.balance tokens")):
        code, _, err = _run(capsys, main, "plan", loader_corpus, "--config", preprocess,
                            "--model", variant, "--layout", LAYOUTS["language dp1"], option,
                            value)
        assert code == 2 and f"{option} {value}, and --model {variant} trains with {key}: " \
            f"the plan would count another run; drop {option}" in err, err


def test_plan_of_a_vlm_s_training_yaml_checks_its_preprocessing_as_the_trainer(
        capsys, loader_corpus, tmp_path):
    """``plan --model TRAIN.yaml`` of a whole VLM: the preprocessing checked against the
    checkpoint as the trainer's start-up checks it (a patch size another than its tower's is
    refused, not planned with wrong token counts, and a normalization other than its saved
    processor's); its own is planned."""
    from mimo_train.families.registry import preprocessing_for
    from mimo_train.inspect_cli import main
    checkpoint = MODELS / "tiny-qwen2-vl"
    own = preprocessing_for(str(checkpoint))
    other = {**own, "modalities": {name: {**settings, "patch_size": 16}
                                   for name, settings in own["modalities"].items()}}
    # images normalized otherwise than the tower's saved processor does
    meaned = {**own, "modalities": {**own["modalities"], "image": {
        **own["modalities"]["image"], "mean": [0.5] * 3, "std": [0.5] * 3}}}
    for name, config in (("own", own), ("other", other), ("meaned", meaned)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        (tmp_path / f"train-{name}.yaml").write_text(yaml.safe_dump({
            "model": {"pretrained": str(checkpoint)},
            "data": {"datasets": [str(loader_corpus)],
                     "preprocess": str(tmp_path / f"{name}.yaml")},
            "train": {"global_batch_size": 4, "micro_batch_size": 2}}))
    layout = "image=dp1,video;language=dp1"
    code, _, err = _run(capsys, main, "plan", loader_corpus, "--model",
                        tmp_path / "train-other.yaml", "--layout", layout)
    assert code == 2 and f"mimo-train refuses it for --model {tmp_path / 'train-other.yaml'}: " \
        f"the preprocessing config is not the one model.pretrained {checkpoint} takes (2 " \
        "settings differ)" in err and f"- modalities.image has patch_size: 16, but " \
        f"model.pretrained {checkpoint}'s tower takes patch_size: 14" in err, err
    code, out, err = _run(capsys, main, "plan", loader_corpus, "--model",
                          tmp_path / "train-own.yaml", "--layout", layout)
    assert code == 0 and "valid" in out, err
    # the tower's saved processor normalizing otherwise: refused as the trainer's start-up
    # refuses it, before any tower is built
    code, _, err = _run(capsys, main, "plan", loader_corpus, "--model",
                        tmp_path / "train-meaned.yaml", "--layout", layout)
    assert code == 2 and f"mimo-train refuses it for --model {tmp_path / 'train-meaned.yaml'}" \
        in err and "encoder module 'image': the image processor saved in" in err and \
        "preprocesses differently: image_mean" in err, err
    # what the trainer's config phase refuses beyond the plan itself: refused here too, by
    # the layout's check and by the advisor (it ranked such runs and printed their command)
    base = yaml.safe_load((tmp_path / "train-own.yaml").read_text())
    for name, model, said in (
            ("lora", {"lora": {"image.encoder": {"targets": ["attn.qkvv"]}}},
             "model.lora.image.encoder.targets has 'attn.qkvv', which names none of its "
             "linear layers"),
            ("frozen", {"freeze": ["language", "image"]},
             "model.freeze freezes every module (")):
        (tmp_path / f"train-{name}.yaml").write_text(yaml.safe_dump(
            {**base, "model": {**base["model"], **model}}))
        for form in (("--layout", layout), ("--gpus", "2")):
            code, _, err = _run(capsys, main, "plan", loader_corpus, "--model",
                                tmp_path / f"train-{name}.yaml", *form)
            assert code == 2 and said in err, (name, form, err)
    # a YAML whose own layout serves no video, which its preprocessing expands: the advisor
    # still ranks the layouts that do, saying why the YAML's is not among them
    (tmp_path / "train-novideo.yaml").write_text(yaml.safe_dump(
        {**base, "layout": "image=dp1;language=dp1"}))
    code, out, err = _run(capsys, main, "plan", loader_corpus, "--model",
                          tmp_path / "train-novideo.yaml", "--gpus", "2")
    assert code == 0 and "note: your layout image=dp1;language=dp1 is not ranked: the " \
        "preprocessing config expands video markers but no module serves video" in err and \
        "image=dp1,video;language=dp1" in out, (out, err)


def test_plan_drops_layouts_that_do_not_fit(capsys, loader_corpus, model_yaml):
    """A GPU with memory between the layouts' peaks (one setting each): the ranked ones fit,
    the dropped ones are over the usable memory; with less than any needs, none fits (exit
    1)."""
    from mimo_train.inspect_cli import main
    _, path, preprocess = model_yaml
    one = ("--recompute", "none", "--distributed-optimizer", "no")   # one setting a layout
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                         "--top", 50, *one, main=main)
    everything = json.loads(out)["ranked"]
    peaks = sorted(r["peak_memory_gib"] for r in everything)
    assert peaks[0] < peaks[-1]
    usable = (peaks[0] + peaks[-1]) / 2
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                         "--gpu-memory-gib", (usable + 1) / 0.9, *one, main=main)
    report = json.loads(out)
    assert code == 0 and report["dropped_layouts"] >= 1
    assert all(r["peak_memory_gib"] <= usable + 1e-6 for r in report["ranked"])
    assert all(r["peak_memory_gib"] > usable - 1e-6 for r in report["dropped"])
    # your layout fitting with none of its settings: said, with its least memory
    largest = max(everything, key=lambda r: r["peak_memory_gib"])
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                         "--gpu-memory-gib", (usable + 1) / 0.9, *one, "--layout",
                         largest["layout"], main=main)
    said = json.loads(out)["yours_not_ranked"]
    found = re.fullmatch(r"not ranked: it fits with none of the settings tried: ([0-9.]+) GiB "
                         r"per rank at the least > ([0-9.]+) usable, on its ([\w+]+) ranks.*", said)
    assert found and _reads_over(*found.groups()[:2], largest["peak_memory_gib"], usable), said
    # named: the module whose ranks hold the most under its least-memory settings
    least = min((r for r in json.loads(out)["dropped"] if r["layout"] == largest["layout"]),
                key=lambda r: r["peak_memory_gib"])
    assert found[3] == max(least["memory_gib"], key=lambda m: least["memory_gib"][m]["total"])
    # a layout of modules apart: the one whose ranks hold more named, not the other
    apart = max((r for r in everything if len(r["memory_gib"]) > 1),
                key=lambda r: r["peak_memory_gib"])
    totals = {module: held["total"] for module, held in apart["memory_gib"].items()}
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                         "--gpu-memory-gib", (apart["peak_memory_gib"] * 0.99 + 1) / 0.9, *one,
                         "--layout", apart["layout"], main=main)
    said = json.loads(out)["yours_not_ranked"]
    assert len(set(totals.values())) > 1 and \
        f", on its {max(totals, key=totals.__getitem__)} ranks" in said, (said, totals)
    # the text: the layouts that fit with no settings counted, the settings that do not
    # fit listed as settings (with all settings tried, each layout fits with some here)
    memory = ("--gpu-memory-gib", (usable + 1) / 0.9)
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                         *memory, main=main)
    every = json.loads(out)
    assert every["dropped"]
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, *memory,
                         main=main)
    assert code == 0 and "closest to fitting: the least memory per rank of the tries that " \
        "do not fit; those ranked above fit" in out
    assert f"{every['fitting_layouts']} fit, {every['dropped_layouts']} do not fit in memory "\
        "with any settings" in out
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4,
                         "--gpu-memory-gib", (peaks[0] / 2 + 1) / 0.9, main=main)
    assert code == 1 and "no layout fits: more GPUs, a GPU with more memory, a smaller micro " \
        "batch, or train less of the model (LoRA, frozen parts: model.lora, model.freeze in a " \
        "training YAML given as --model)\nclosest to fitting: the least memory per rank of " \
        "the tries that do not fit\n" in out, out
    # each closest try with its memory's parts (of its fullest module's rank)
    assert re.search(r"\n  \S+ \([^)]*\): [0-9.]+ GiB per rank > [0-9.]+ \((language|image)"
                     r"\S*: weights [0-9.]+, grads [0-9.]+, optimizer [0-9.]+, activations "
                     r"[0-9.]+, temporary [0-9.]+\)\n", out), out
    # less memory than the model's own state (weights, gradients, optimizer) on any rank:
    # no batch or sample size helps, and the line says so instead of suggesting them
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                         "--gpu-memory-gib", (0.001 + 1) / 0.9, main=main)
    dropped = json.loads(out)
    state = dropped["least_state_gib"]
    assert state > 0.001 and all(
        max(m["weights"] + m["gradients"] + m["optimizer"] + m["adapters"]
            for m in r["memory_gib"].values()) >= state - 1e-9 for r in dropped["dropped"])
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4,
                         "--gpu-memory-gib", (0.001 + 1) / 0.9, main=main)
    found = re.search(r"no layout fits: the model's own state passes a GPU's memory in every "
                      r"try \(weights, gradients and optimizer state: ([0-9.]+) GiB on a rank "
                      r"at the least > ([0-9.]+) usable\), whatever the batch or the samples: "
                      "more GPUs", out)
    assert code == 1 and found and _reads_over(*found.groups(), state, 0.001), out
    assert "a smaller micro batch" not in out


def test_a_memory_over_its_limit_reads_larger_at_any_closeness():
    """``X GiB > Y``: one decimal where it tells them apart, as many more as it takes."""
    from mimo_train.planning.advisor.report import gib_over
    assert gib_over(70.64, 68.2) == ("70.6", "68.2")
    assert gib_over(0.1234, 0.1201) == ("0.123", "0.120")
    assert gib_over(0.05, 0.001) == ("0.1", "0.0")
    assert gib_over(2.00004, 2.00001) == ("2.0000", "2.0000")     # at most four


def _reads_over(over: str, limit: str, over_gib: float, limit_gib: float) -> bool:
    """A line's "``over`` > ``limit``" GiB: each the value rounded to the places it shows (one,
    or more), the first reading larger (not "0.1 > 0.1")."""
    places = len(over.partition(".")[2])
    return places >= 1 and len(limit.partition(".")[2]) == places and \
        float(over) == round(over_gib, places) and float(limit) == round(limit_gib, places) \
        and float(over) > float(limit)


def test_plan_advisor_options_errors(capsys, loader_corpus, model_yaml):
    from mimo_data.inspect.cli import main as data_main
    from mimo_train.inspect_cli import main
    _, path, preprocess = model_yaml
    code, _, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 2, main=data_main)
    assert code == 2 and "(a training YAML) needs mimo_train: run the mimo-inspect command " \
        "of a full install" in err, err
    code, _, err = _run(capsys, main, "plan", loader_corpus, "--config", preprocess, "--gpus",
                        2, "--global-batch-size", 4, "--micro-batch-size", 1)
    assert code == 2 and "--model" in err
    # a language model alone for a config with images: no encoder dims to guess
    language_only = path.parent / "language-only"
    language_only.mkdir(exist_ok=True)
    (language_only / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, _, err = _plan(capsys, loader_corpus, preprocess, language_only, "--gpus", 2,
                         main=main)
    assert code == 2 and "language model alone" in err and "image" in err, err
    assert "model.encoders" in err
    # what --model is not: each said in one line naming what it takes
    takes = "give a training config YAML, a transformers checkpoint directory (or its " \
        "config.json) or a hub name already in the local cache"
    for given, said in ((path.parent / "nowhere", f"{path.parent / 'nowhere'} does not exist"),
                        (path.parent / "nowhere.json", "is not a checkpoint's config.json"),
                        (loader_corpus, f"{loader_corpus} holds no config.json")):
        code, _, err = _plan(capsys, loader_corpus, preprocess, given, "--gpus", 2, main=main)
        assert code == 2 and said in err and err.rstrip().endswith(takes), err
    code, _, err = _plan(capsys, loader_corpus, preprocess, preprocess, "--gpus", 2, main=main)
    assert code == 2 and f"{preprocess} is a preprocessing config (tokenizer and modalities " \
        "at its top level), not a training config" in err, err
    # a whole VLM whose image token the preprocessing's tokenizer (another model's) puts
    # elsewhere: the trainer's start-up check refuses it, so the advisor does (its positions
    # made M-RoPE)
    mrope = path.parent / "preprocess_mrope.yaml"
    mrope.write_text(yaml.safe_dump({**yaml.safe_load(preprocess.read_text()),
                                     "positions": "mrope"}))
    code, _, err = _plan(capsys, loader_corpus, mrope,
                         MODELS / "published" / "Qwen--Qwen2-VL-2B-Instruct", "--gpus", 2,
                         main=main)
    assert code == 2 and "the preprocessing config's tokenizer" in err and \
        "is not model.pretrained's" in err, err
    # numbers that cannot be: refused by argparse (exit 2), no silent default for 0
    for option, value in (("--mfu", 0), ("--mfu", 1.5), ("--gpu-memory-gib", 0),
                          ("--gpu-tflops", -1), ("--gpus-per-node", 0), ("--gpus", 0),
                          ("--gpu-tflops", "inf"), ("--gpu-memory-gib", "nan"), ("--top", 0),
                          ("--steps", 0), ("--layout", "")):
        with pytest.raises(SystemExit) as exit_:
            _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, option, value,
                  main=main)
        assert exit_.value.code == 2 and option in capsys.readouterr().err
    # memory the advisor's headroom and reserve leave nothing of
    code, _, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4,
                         "--gpu-memory-gib", 1.1, main=main)
    assert code == 2 and "--gpu-memory-gib 1.1 leaves nothing to plan in" in err, err
    # your layout on another number of GPUs, or one its check refuses: said, not ranked
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 5, "--layout",
                           LAYOUTS["language dp1"], main=main)
    assert code == 0, err
    assert f"yours     {LAYOUTS['language dp1']}: not ranked: uses 4 GPUs, not 5" in out
    assert "<- yours" not in out
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                           "--layout", "image=dp1;language=dp3", main=main)
    report = json.loads(out)
    assert code == 0 and report["yours_not_ranked"].startswith("not ranked: ")
    assert "global" in report["yours_not_ranked"]       # the LayoutError's own words
    assert "image=dp1;language=dp3" not in [r["layout"] for r in report["ranked"]]
    code, _, err = _run(capsys, main, "plan", loader_corpus, "--config", preprocess,
                        "--global-batch-size", 4, "--micro-batch-size", 1)
    assert code == 2 and "--layout" in err
    # a layout alone: valid for the data, the model's rules said to be unchecked
    code, out, err = _run(capsys, main, "plan", loader_corpus, "--config", preprocess,
                          "--global-batch-size", 4, "--micro-batch-size", 1, "--layout",
                          "language=dp1;image=dp1,off0")
    assert code == 0 and out.rstrip().endswith(
        "model     its rules not checked (experts over ep, heads over tp, ...): give --model "
        "(its config.json or a training YAML) for mimo-train's verdict"), (out, err)
    # one layout with --model and no --gpus: the trainer's rules for that model, then the
    # plan of that layout; a layout it refuses exits 2 as mimo-train would (its 2 heads do not
    # split over tp4), without mimo_train said to need it
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--layout",
                           LAYOUTS["language dp1"], main=main)
    assert code == 0 and "(non-colocated, 4 ranks): valid" in out, (out, err)
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--layout",
                           "image=dp1;language=tp4", main=main)
    assert code == 2 and "--layout image=dp1;language=tp4: mimo-train refuses it for --model " \
        f"{path}: " in err and "attention heads" in err, err
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--layout",
                         "image=dp1;language=tp4", "--json", main=main)
    refused = json.loads(out)
    assert code == 2 and refused["valid"] is False and "attention heads" in refused["problem"]
    assert refused["layout"].startswith("image=tp1,cp1,pp1,dp1"), refused
    code, _, err = _plan(capsys, loader_corpus, preprocess, path, "--layout",
                         LAYOUTS["language dp1"], main=data_main)
    assert code == 2 and "--model (a training YAML) needs mimo_train" in err, err
    # a YAML's own settings under the layout, as its start-up resolves them (not the settings
    # the advisor would choose): sequence parallelism without tp is refused
    parallel = path.parent / "sequence_parallel.yaml"
    config = yaml.safe_load(path.read_text())
    config["model"]["language"]["sequence_parallel"] = True
    parallel.write_text(yaml.safe_dump(config))
    code, _, err = _plan(capsys, loader_corpus, preprocess, parallel, "--layout",
                         LAYOUTS["language dp1"], main=main)
    assert code == 2 and "model.language.sequence_parallel needs the language model's tensor " \
        "parallelism" in err, err
    # the plan drawn is the YAML's run: packed as it says without --packing, and --packing
    # against its data.packing: false is said
    assert config["data"]["packing"] is True
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--layout",
                           LAYOUTS["language dp1"], main=main)
    assert code == 0 and "this plan's packed" in out, (out, err)
    config["data"]["packing"] = False
    unpacked = path.parent / "unpacked.yaml"
    unpacked.write_text(yaml.safe_dump(config))
    code, _, err = _plan(capsys, loader_corpus, preprocess, unpacked, "--layout",
                         LAYOUTS["language dp1"], "--packing", main=main)
    assert code == 2 and f"--packing, but --model {unpacked} says data.packing: false" in err, err
    # a model that cannot be read: said as such, not as a refused layout
    code, _, err = _plan(capsys, loader_corpus, preprocess, MODELS / "tiny-qwen2", "--layout",
                         LAYOUTS["language dp1"], main=main)
    assert code == 2 and f"error: --model {MODELS / 'tiny-qwen2'}: " in err and \
        "refuses" not in err, err
    # a micro batch that does not divide the global batch: a usage error, not "no layout fits"
    code, out, err = _run(capsys, main, "plan", loader_corpus, "--config", preprocess, "--model",
                          language_only, "--gpus", 2, "--global-batch-size", 8,
                          "--micro-batch-size", 3)
    assert code == 2 and "--global-batch-size 8 is not a whole number of micro-batches of " \
        "--micro-batch-size 3: give" in err and "no layout fits" not in out, (out, err)


# ------------------------------------------------------------------------------ Qwen3.5

# the dense Qwen3.5 replica's language model (tools/make_published.py): h 64, 4 heads of 64 in
# 2 query groups, the attention gate doubling q_proj; SwiGLU MLP 96; delta-net layers of 2 key
# heads and 4 value heads of 16 (key_dim 32, value_dim 64), a convolution of 4; 248320 rows tied
HYBRID = Stack(4, 64, 4, 2, 64, 96, gated=True, vocab=248320, tied=True,
               layer_types=(LINEAR, LINEAR, LINEAR, FULL),
               linear=LinearAttention(conv_kernel=4, key_head_dim=16, value_head_dim=16,
                                      num_key_heads=2, num_value_heads=4),
               attention_gate=True)


def test_hybrid_parameters_by_hand():
    # a delta-net layer: in_proj 64 x (32 + 32 + 64 + 64 + 4 + 4) = 12800, out_proj 64 x 64 =
    # 4096, conv1d 4 x 128 = 512, A_log and dt_bias 4 each: 17416; MLP 64 x 96 x 3 = 18432;
    # whole on every TP rank: two norms 128 and the gated norm 16
    assert HYBRID.layer_parameters(LINEAR) == (35848, 144)
    # a gated attention layer: q_proj 64 x 512 (queries and gates) 32768, k_proj and v_proj
    # 64 x 128 each 16384, o_proj 256 x 64 16384: 65536; MLP 18432; norms 128
    assert HYBRID.layer_parameters(FULL) == (83968, 128)
    # 3 x 35992 + 84096 + final norm 64 + the tied embedding 248320 x 64 = 15892480
    assert HYBRID.parameters() == 107976 + 84096 + 64 + 15892480 == 16084616
    # pp2, tp2: stage 0 holds layers 0, 1 (delta-net) and the embedding, stage 1 layers 2
    # (delta-net) and 3 (attention), the final norm and the output layer's copy
    assert mem.language_stage_parameters(HYBRID, tp=2, pp=2, stage=0) == \
        2 * (17924 + 144) + 7946240
    assert mem.language_stage_parameters(HYBRID, tp=2, pp=2, stage=1) == \
        (17924 + 144) + (41984 + 128) + 64 + 7946240
    # a mixture: 4 experts of 24 (64 x 48 + 24 x 64 = 4608 each), the router 64 x 4, a shared
    # expert of 32 (64 x 64 + 32 x 64 = 6144) and its gate 64: 18432 + 256 + 6144 + 64
    moe = Stack(4, 64, 4, 2, 64, 24, gated=True, experts=4, experts_per_token=2,
                shared_expert_ffn=32, layer_types=HYBRID.layer_types, linear=HYBRID.linear,
                attention_gate=True)
    assert moe.layer_parameters(LINEAR) == (17416 + 24896, 144)
    # active: 2 of the 4 experts, 2 x 4608 fewer weights in each of 4 layers
    assert moe.parameters() - moe.active_parameters() == 4 * 2 * 4608


def test_hybrid_activation_bytes_by_hand():
    bf16 = mem.Settings("bf16")
    # a gated delta-net layer, one sample of 100 tokens (2 chunks: 128 chunked positions),
    # bf16: outside the TP regions 8 x 64 x 100 = 51200, the MLP 6 x 96 x 100 = 57600;
    # the delta-net, fp32 per token: convolution 3 x 128, l2 norms 2 x 32 + 2 x 2, gates
    # 4 x 4, q k v 4 x (2 x 16 + 16), gated norm 4 x 64 + 4: 920 x 100 = 92000; per chunked
    # position 4 x (6 x 16 + 3 x 16 + 4 + 5 x 64) + 4 x 16 x 16 / 64: 1888 x 128 = 241664;
    # (92000 + 241664) x 4 = 1334656 bytes; bf16: beta 4, gated norm and out_proj input
    # 2 x 64: 100 x 2 x 132 = 26400
    assert mem.layer_activation_bytes(HYBRID, 100, 100 ** 2, bf16, kind=LINEAR,
                                      chunked=128) == 51200 + 57600 + 1334656 + 26400
    # the gated attention layer: 51200 + (10 x 256 (q, the keys and values repeated to the
    # query heads, the output projection's input, the kernel's output) + 4 x 256 (the gate)
    # + 6 x 96) x 100 = 416000; no scores kept with a flash / sdpa / varlen kernel
    assert mem.layer_activation_bytes(HYBRID, 100, 100 ** 2, bf16) == 51200 + 416000
    # tp2 with sequence parallel: everything halves
    assert mem.layer_activation_bytes(HYBRID, 100, 100 ** 2, bf16, tp=2,
                                      sequence_parallel=True, kind=LINEAR,
                                      chunked=128) == (51200 + 57600 + 1334656 + 26400) / 2
    # fp32: only the run-width parts double
    assert mem.layer_activation_bytes(HYBRID, 100, 100 ** 2, mem.Settings("fp32"),
                                      kind=LINEAR, chunked=128) == \
        2 * (51200 + 57600) + 1334656 + 2 * 26400
    # the stack: 3 delta-net layers, 1 attention layer, the hidden states' gradient 100 x 64 x 2
    linear, full, logits = 1469856, 467200, 12800
    assert mem.language_activation_bytes(HYBRID, [100], bf16) == 3 * linear + full + logits
    # full recompute: each layer's input 2 x 64 x 100, one layer's set, the largest kind's
    assert mem.language_activation_bytes(HYBRID, [100], mem.Settings(
        "bf16", recompute="full")) == 4 * 12800 + linear + logits
    # packed samples of 64 and 36 tokens: 64 + 64 chunked positions, as one of 100 padded to
    # 128 (each sample its own chunks: two of 10 tokens take 128, one of 20 takes 64)
    assert mem.language_activation_bytes(HYBRID, [64, 36], bf16) == 3 * linear + full + logits
    assert mem.chunked_positions([10, 10]) == 128 and mem.chunked_positions([20]) == 64


class SavedBytes:
    """The bytes of the tensors autograd saves for a backward pass while entered (each
    storage once; ``module``'s own parameters not counted): ``total``."""

    def __init__(self, module):
        import torch
        self.own = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.storages: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.own:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedBytes:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def test_delta_net_bytes_are_what_the_layer_saves():
    """megatron-core's ``GatedDeltaNet`` with mimo's kernels (``mcore.gated_delta_net``, the
    layer the trainer builds, in bf16 as a GPU trains it; one-rank world, in process) on one
    sample of 200 tokens (4 chunks, padded to 256): the bytes of every tensor autograd saves
    for its backward pass (each storage once, the layer's own parameters not counted) are
    ``delta_net_bytes`` plus its input (the in_proj input, counted outside the TP regions)
    within 1%: what the formula leaves out (index tensors, the chunk mask, the padding of the
    convolution's window, a bf16 copy of A_log and dt_bias) is 0.6% here."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core.transformer.spec_utils import build_module

    from mimo_train.mcore import ProcessGroupCollection, TransformerConfig
    from mimo_train.mcore import gated_delta_net
    from mimo_train.runtime import distributed

    linear, tokens = HYBRID.linear, 200
    assert linear is not None
    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
        activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1, 1, 1, 0],
        linear_conv_kernel_dim=linear.conv_kernel, linear_key_head_dim=linear.key_head_dim,
        linear_value_head_dim=linear.value_head_dim, linear_num_key_heads=linear.num_key_heads,
        linear_num_value_heads=linear.num_value_heads, params_dtype=torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False, bias_dropout_fusion=False)
    with distributed.alone():
        group = dist.new_group([0])
        layer = build_module(gated_delta_net.module_spec(), config=config, layer_number=1,
                             pg_collection=ProcessGroupCollection(tp=group, cp=group))
        layer = layer.to(torch.bfloat16)
        hidden = torch.randn(tokens, 1, 64, dtype=torch.bfloat16, requires_grad=True)
        with SavedBytes(layer) as saved:
            layer(hidden, None)
    predicted = mem.delta_net_bytes(HYBRID, tokens, 256, 2) + tokens * 64 * 2
    assert saved.total == pytest.approx(predicted, rel=0.01)


TOWER_CONFIGS = {kind: PUBLISHED_TOWERS[kind] for kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")}


# every tower under SDPA; mimo's varlen wrapper is the same for the family: one tower's
@pytest.mark.parametrize("kind, varlen", [(kind, False) for kind in sorted(TOWER_CONFIGS)] +
                         [("qwen2_vl", True)])
def test_tower_bytes_are_what_the_tower_saves(kind, varlen, monkeypatch):
    """A transformers tower as the trainer runs it (the published tower config, two blocks,
    bf16; transformers' SDPA, or mimo's varlen attention with a kernel that keeps what flash
    kernels keep: its inputs and output, the real one needs CUDA), on two images of 8 x 8
    patches: the bytes of every tensor autograd saves inside its blocks (each storage once,
    the weights not counted) are ``layer_activation_bytes`` of its ``Stack`` per block within
    2% (left out: the norms' statistics, the rotary tables, SDPA's log-sum-exp). Qwen2-VL:
    QuickGELU; Qwen2.5-VL: RMSNorm and a gated SiLU (each fused by ``model.tower_fusions``,
    as the trainer builds the tower); Qwen3-VL: GELU; under SDPA the values a copy, not a
    view keeping the whole fused QKV output."""

    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig

    import torch.nn.attention.varlen as varlen_module
    from mimo_train.families.registry import ENCODERS
    from mimo_train.model.tower_attention import set_attention
    from mimo_train.model.tower_fusions import fuse
    from mimo_train.planning.dims import QWEN_VARLEN_ATTENTION, tower_from_hf

    class FlashLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, bounds):
            with torch.no_grad():
                out = torch.cat([F.scaled_dot_product_attention(
                    *(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
                    for a, b in zip(bounds, bounds[1:])])
            ctx.save_for_backward(q, k, v, out)
            return out

    monkeypatch.setattr(varlen_module, "varlen_attn", lambda q, k, v, cu, *rest, **kw:
                        FlashLike.apply(q, k, v, cu.tolist()))
    config = AutoConfig.from_pretrained(REPO / "tools" / "published" / TOWER_CONFIGS[kind]
                                        ).vision_config
    config.depth = 2
    for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        if hasattr(config, key):
            setattr(config, key, [1] if key == "fullatt_block_indexes" else [])
    torch.manual_seed(0)
    tower = ENCODERS[kind].tower_class()._from_config(config, dtype=torch.bfloat16)
    fuse(tower, set_attention(tower, "varlen" if varlen else "sdpa",   # as the trainer
                              by_boundaries=True))                     # builds it
    saved = SavedBytes(tower)
    for block in tower.blocks:            # inside the blocks only (a hook returns nothing)
        block.register_forward_pre_hook(lambda *_: saved.hooks.__enter__())
        block.register_forward_hook(lambda *_: saved.hooks.__exit__(None, None, None))
    grid = torch.tensor([[1, 8, 8]] * 2)
    columns = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    patches = int(grid.prod(-1).sum())
    tower(hidden_states=torch.randn(patches, columns, dtype=torch.bfloat16), grid_thw=grid)
    stack = tower_from_hf(kind, config).stack
    if varlen:
        stack = dataclasses.replace(stack, attention_kept=QWEN_VARLEN_ATTENTION)
    predicted = mem.layer_activation_bytes(stack, patches, patches * 64, mem.Settings("bf16"))
    assert saved.total / 2 == pytest.approx(predicted, rel=0.02)


# Qwen/Qwen3.5-27B's config.json as published on the Hugging Face hub (huggingface.co/Qwen/
# Qwen3.5-27B/blob/main/config.json), the keys the 35B-A3B's (tools/published, README section
# 10) has, with the 27B's values. Where they come from (found with the search tool, the hub
# itself not reachable): the language model's dims (64 layers, hidden 5120, MLP 17408, 24
# heads of 256 in 4 query groups, untied 248320 rows, a quarter of each head rotating, rope
# theta 1e7, the attention output gate) in THUDM/slime's scripts/models/qwen3.5-27B.sh (commit
# 624b824a); the delta-net's (16 key heads and 48 value heads of 128, kernel 4) in Modular
# MAX's Qwen3_5Config (docs.modular.com/max/api/python/pipelines.architectures.qwen3_5) and in
# the config.json of fine-tunes of it on the hub (huggingface.co/EclipseMist/hababa,
# huggingface.co/ApolloRaines/Sharona_Q27B-R_CodeSecurity: the same text dims, the 3:1 layer
# pattern); the layout (16 x (3 delta-net, 1 attention), 1 MTP layer, M-RoPE sections
# [11, 11, 10]) and the tower (27 blocks of 1152, 16-pixel patches) in the model card as
# quoted at hugingapi.com/TevunahAi/Qwen3.5-27B-TevunahAi-GPTQ; the tower's other keys are the
# 35B-A3B's (one tower for the family), its output the 27B's width. The token ids are the
# family's (the 35B-A3B's, README section 10).
QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "image_token_id": 248056,
    "model_type": "qwen3_5",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "bos_token_id": None, "dtype": "bfloat16", "eos_token_id": 248044,
        "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],     # x 16, below
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144, "mlp_only_layers": [],
        "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "num_attention_heads": 24,
        "num_hidden_layers": 64, "num_key_value_heads": 4, "pad_token_id": None,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                            "partial_rotary_factor": 0.25, "rope_theta": 10000000,
                            "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 248320},
    "tie_word_embeddings": False, "transformers_version": "4.57.1", "video_token_id": 248057,
    "vision_config": {
        "deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02,
        "intermediate_size": 4304, "model_type": "qwen3_5", "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": 5120, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 248054, "vision_start_token_id": 248053}
QWEN3_5_27B["text_config"]["layer_types"] *= 16
QWEN3_5_35B = REPO / "tools" / "published" / "Qwen--Qwen3.5-35B-A3B"
# Qwen/Qwen3.5-397B-A17B's config.json (huggingface.co/Qwen/Qwen3.5-397B-A17B/blob/main/
# config.json; the hub not reachable): the 35B-A3B's published one with the 397B's text dims,
# found with the search tool: 60 layers, 15 x (3 delta-net, 1 attention), hidden 4096, 32 heads
# of 256 in 2 query groups, 512 experts of 1024, 10 a token, a shared expert of 1024, 248320
# untied rows in THUDM/slime's scripts/models/qwen3.5-397B-A17B.sh (its Megatron arguments);
# the delta-net's 16 key and 64 value heads of 128 in an MLPerf training reference's model
# table "taken from the config.json" and a Qwen3.5-397B weight packer's model_config (the same
# text dims); the tower the family's (27 blocks of 1152), its output the 397B's width.
QWEN3_5_397B = json.loads((QWEN3_5_35B / "config.json").read_text())
QWEN3_5_397B["text_config"].update({
    "hidden_size": 4096, "num_hidden_layers": 60,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],       # x 15, below
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 64, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024})
QWEN3_5_397B["text_config"]["layer_types"] *= 15
QWEN3_5_397B["vision_config"]["out_hidden_size"] = 4096
QWEN3_5_MODALITIES = {"image": "image", "video": "image"}        # one tower serves both


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory) -> dict:
    """The three checkpoints' config.json (the 27B's and the 397B-A17B's written from
    ``QWEN3_5_27B`` and ``QWEN3_5_397B``; the 35B-A3B's published one), a training YAML of
    each (unpacked data) and the family's
    preprocessing config (the 35B-A3B replica's: one tokenizer and processor for the family),
    sequences up to 2048 tokens."""
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.config import TrainConfig
    from mimo_train.families.registry import preprocessing_for
    tmp = tmp_path_factory.mktemp("qwen3_5")
    for name, config in (("Qwen3.5-27B", QWEN3_5_27B), ("Qwen3.5-397B-A17B", QWEN3_5_397B)):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config, indent=1))
    preprocess = tmp / "preprocess.yaml"
    preprocess.write_text(yaml.safe_dump({
        **preprocessing_for(str(MODELS / "published" / "Qwen--Qwen3.5-35B-A3B")),
        "seq_length": 2048}))
    found = {"preprocess": preprocess, "config": PreprocessConfig.from_yaml(str(preprocess))}
    for name, checkpoint in (("27B", tmp / "Qwen3.5-27B"), ("35B-A3B", QWEN3_5_35B),
                             ("397B-A17B", tmp / "Qwen3.5-397B-A17B")):
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(TrainConfig.load(None, [
            f"data.datasets=[{tmp}]", f"data.preprocess={preprocess}",
            f"model.pretrained={checkpoint}", "data.packing=false"]).to_dict()))
        found[name] = {"checkpoint": checkpoint, "yaml": path}
    return found


def _qwen3_5_model(qwen3_5, name: str):
    from mimo_train.planning.advisor import read_model
    return read_model(str(qwen3_5[name]["yaml"]), str(qwen3_5["preprocess"]),
                      qwen3_5["config"], QWEN3_5_MODALITIES, "bf16")


def test_qwen3_5_27b_layers_by_hand(qwen3_5):
    """The 27B as the advisor reads it, and one layer of each kind by hand."""
    from mimo_train.planning.flops import layer_flops_per_token, layer_square_flops
    stack = _qwen3_5_model(qwen3_5, "27B").dims.language
    assert stack == Stack(64, 5120, 24, 4, 256, 17408, gated=True, vocab=248320,
                          layer_types=tuple(QWEN3_5_27B["text_config"]["layer_types"]),
                          linear=LinearAttention(4, 128, 128, 16, 48), attention_gate=True)
    assert stack.kinds() == {LINEAR: 48, FULL: 16}
    # a delta-net layer (key_dim 2048, value_dim 6144, 48 value heads), per token: in_proj
    # 2·5120·(2·2048 + 2·6144 + 2·48) = 168755200, out_proj 2·6144·5120 = 62914560, MLP
    # 2·5120·17408·3 = 534773760, convolution 2·4·10240 = 81920, state 48·6·128·128 = 4718592
    assert layer_flops_per_token(stack, LINEAR) == 771244032
    assert layer_square_flops(stack, LINEAR) == 48 * (5 * 128 + 3 * 128) == 49152
    # a gated attention layer: q_proj (queries and gates) + k, v: 2·5120·(2·6144 + 2·1024) =
    # 146800640, o_proj 62914560, MLP 534773760; its square 4·6144 per s²
    assert layer_flops_per_token(stack, FULL) == 744488960
    assert layer_square_flops(stack, FULL) == 24576
    # parameters: in_proj 5120 x 16480 = 84377600, out_proj 31457280, conv 40960, A_log and
    # dt_bias 96, MLP 267386880; norms 10240 + the gated norm's 128
    assert stack.layer_parameters(LINEAR) == (383262816, 10368)
    assert stack.layer_parameters(FULL) == (73400320 + 31457280 + 267386880, 10240)
    # activations per token in bf16 (a multiple of 64 tokens): a delta-net layer: 8·5120 =
    # 40960 outside, MLP 6·17408 = 104448, the delta-net 4·(3·10240 + 2·2048 + 2·16 + 4·48 +
    # 48·384 + 4·6144 + 48 + 48·(6·128 + 3·128 + 4 + 5·64 + 128·128/64)) + 2·(48 + 2·6144)
    # = 4·161232 + 24672 = 669600
    bf16 = mem.Settings("bf16")
    assert mem.layer_activation_bytes(stack, 64, 64 ** 2, bf16, kind=LINEAR) == \
        64 * (40960 + 104448 + 669600)
    # a gated attention layer: 40960 + 10·6144 + 4·6144 (the gate) + 6·17408 = 231424
    assert mem.layer_activation_bytes(stack, 64, 64 ** 2, bf16) == 64 * 231424


def test_qwen3_5_35b_a3b_layers_by_hand(qwen3_5):
    from mimo_train.planning.flops import layer_flops_per_token
    stack = _qwen3_5_model(qwen3_5, "35B-A3B").dims.language
    assert stack == Stack(40, 2048, 16, 2, 256, 512, gated=True, vocab=248320, experts=256,
                          experts_per_token=8, shared_expert_ffn=512,
                          layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 10,
                          linear=LinearAttention(4, 128, 128, 16, 32), attention_gate=True)
    # the MLP per token: 8 experts 8·(2·2048·1024 + 2·512·2048) = 50331648, the router
    # 2·2048·256 = 1048576, the shared expert 2·2048·1024 + 2·512·2048 = 6291456, its gate 4096
    mlp = 50331648 + 1048576 + 6291456 + 4096
    # a delta-net layer: in_proj 2·2048·(4096 + 8192 + 64) = 50593792, out_proj 2·4096·2048 =
    # 16777216, convolution 2·4·8192 = 65536, state 32·6·128·128 = 3145728
    assert layer_flops_per_token(stack, LINEAR) == 50593792 + 16777216 + 65536 + 3145728 + mlp
    # gated attention: 2·2048·(2·4096 + 2·512) = 37748736, o_proj 2·4096·2048 = 16777216
    assert layer_flops_per_token(stack, FULL) == 37748736 + 16777216 + mlp


def _meta_parameters(checkpoint) -> dict[str, int]:
    """transformers' own model of ``checkpoint``'s config.json, built on the meta device:
    its parameters by what mimo counts (language, tower) and what it leaves out."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(checkpoint))
    found = dict.fromkeys(("language", "tower", "left out"), 0)
    for name, parameter in model.named_parameters():
        part = "tower" if ".visual." in name else "language"
        if name.endswith(("q_norm.weight", "k_norm.weight", ".bias", "pos_embed.weight")):
            part = "left out"
        found[part] += parameter.numel()
    return found


@pytest.mark.parametrize("name", ["27B", "35B-A3B", "397B-A17B"])
def test_qwen3_5_parameters_are_the_published_sizes(qwen3_5, name):
    """The advisor's parameter counts are transformers' own model's but what mimo's counts
    leave out (the attention's q/k norms, the tower's position embedding and biases: 3M, 0.011%;
    transformers builds no multi-token-prediction layer, nor does mimo), and the published
    sizes within the rounding of their names to whole billions (±0.5B): 27.35B for "27B"
    (the tower 0.46B included), 35.10B for "35B" and, of the language model's matmul weights,
    2.95B a token goes through for "A3B" (3.45B with the embedding and output layer's);
    396.80B for "397B", 17.35B a token goes through for "A17B" (with the embedding and output
    layer's; 16.33B without: the "A3B" count would be 0.67B off)."""
    model = _qwen3_5_model(qwen3_5, name)
    language, tower = model.dims.language, model.dims.encoders["image"]
    meta = _meta_parameters(qwen3_5[name]["checkpoint"])
    assert language.parameters() == meta["language"]
    assert tower.parameters() == meta["tower"]
    assert meta["left out"] < 2e-4 * (meta["language"] + meta["tower"])
    total = language.parameters() + tower.parameters()
    published = {"27B": 27e9, "35B-A3B": 35e9, "397B-A17B": 397e9}[name]
    assert abs(total - published) <= 0.5e9, total
    if name == "35B-A3B":
        active = language.active_parameters() - language.vocab * language.hidden
        assert abs(active - 3e9) <= 0.5e9, active
    if name == "397B-A17B":
        assert abs(language.active_parameters() - 17e9) <= 0.5e9, language.active_parameters()


def _qwen3_5_workload(packing: bool = False) -> dict:
    """Two steps of 128 samples of 256 to 1279 tokens, each with an image of 16 x 16
    placeholders (32 x 32 patches of 16 pixels), micro-batches of 8."""
    return {"global_batch_size": 128, "micro_batch_size": 8, "seq_length": 2048,
            "packing": packing, "epochs": 1, "vocab_size": 248320,
            "modalities": QWEN3_5_MODALITIES,
            "steps": [[{"tokens": 256 + (97 * i) % 1024, "trained": 256 + (97 * i) % 1024,
                        "items": {"image": [256]},
                        "grids": {"image": [[1, 16, 16]]}} for i in range(128)]
                      for _ in range(2)]}


# (model, H100s, whether some layout fits): on 8 H100s neither fits, whatever the layout
# (the 27B's weights, gradients and Adam state are 492 GB, the 35B-A3B's 632 GB, the towers on
# ranks of their own; expert parallelism saves the experts' weights and gradients, not their
# Adam state, which the distributed optimizer already shards over the stage's tp x dp ranks);
# the 27B fits on 16, the 35B-A3B on 16 colocated (dp16 with ep16: 70.3 of 70.6 usable GiB on
# this workload, every token trained: the loss's trained tokens' logits and no fp32 softmax of
# them kept) and on 32
QWEN3_5_CASES = [("27B", 8, False), ("27B", 16, True), ("35B-A3B", 8, False),
                 ("35B-A3B", 16, True), ("35B-A3B", 32, True)]


@pytest.mark.parametrize("name,gpus,fits", QWEN3_5_CASES)
def test_qwen3_5_advisor_ranks_layouts(qwen3_5, name, gpus, fits):
    """The advisor on the 27B and the 35B-A3B (as ``mimo-inspect plan --model`` reads a
    training YAML of them): the layouts that fit, fastest first, each within the usable
    memory and with settings the trainer's start-up takes; where none fits, each candidate's
    fullest rank is over it."""
    from mimo_data.inspect.advice import AdvisorRequest
    from mimo_data.loading.loader import variable_token_modalities
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.planning.advisor import run_advisor
    model = _qwen3_5_model(qwen3_5, name)
    config = qwen3_5["config"]
    request = AdvisorRequest(str(qwen3_5[name]["yaml"]), str(qwen3_5["preprocess"]), gpus,
                             gpu="h100", top=50)
    report = run_advisor(model, _qwen3_5_workload(), request,
                         variable_token_modalities(config), list(config.modalities))
    ranked, usable = report["ranked"], report["gpu"]["usable_gib"]
    assert report["layouts"] >= 2
    assert bool(ranked) is fits, [(r["layout"], r["peak_memory_gib"]) for r in
                                   ranked + report["dropped"]]
    if not fits:
        assert report["dropped"] and all(r["peak_memory_gib"] > usable
                                         for r in report["dropped"])
        return
    times = [r["step_s"] for r in ranked]
    assert times == sorted(times)
    linear = model.dims.language.linear
    assert linear is not None
    for r in ranked:
        assert r["fits"] and r["peak_memory_gib"] <= usable and 0 < r["mfu"] < 1
        tp = Layout.parse(r["layout"]).language.tp
        assert linear.num_key_heads % tp == 0 and linear.num_value_heads % tp == 0
        resolve(TrainConfig.load(str(qwen3_5[name]["yaml"]), r["overrides"]))


# ------------------------------------------------------------------ expert parallelism

QWEN3_VL_30B = REPO / "tools" / "published" / "Qwen--Qwen3-VL-30B-A3B-Instruct"


@pytest.fixture(scope="module")
def qwen3_vl_moe(tmp_path_factory) -> dict:
    """Qwen3-VL-30B-A3B-Instruct's published config.json (tools/published: 48 layers of 128
    experts of 768, 8 a token) as a training YAML (unpacked data), with the family's
    preprocessing (the replica's tokenizer and processors), sequences up to 4096 tokens."""
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.config import TrainConfig
    from mimo_train.families.registry import preprocessing_for
    tmp = tmp_path_factory.mktemp("qwen3_vl_moe")
    preprocess = tmp / "preprocess.yaml"
    preprocess.write_text(yaml.safe_dump({
        **preprocessing_for(str(MODELS / "published" / "Qwen--Qwen3-VL-30B-A3B-Instruct")),
        "seq_length": 4096}))
    path = tmp / "30B-A3B.yaml"
    path.write_text(yaml.safe_dump(TrainConfig.load(None, [
        f"data.datasets=[{tmp}]", f"data.preprocess={preprocess}",
        f"model.pretrained={QWEN3_VL_30B}", "data.packing=false"]).to_dict()))
    return {"preprocess": preprocess, "yaml": path,
            "config": PreprocessConfig.from_yaml(str(preprocess))}


def _moe_workload() -> dict:
    """One step of 256 samples of 150 to 405 tokens (about the sample corpus's 271), each with
    an image of 8 x 8 placeholders, micro-batches of 2."""
    return {"global_batch_size": 256, "micro_batch_size": 2, "seq_length": 4096,
            "packing": False, "epochs": 1, "vocab_size": 151_700,
            "modalities": QWEN3_5_MODALITIES,
            "steps": [[{"tokens": 150 + (37 * i) % 256, "trained": 150 + (37 * i) % 256,
                        "items": {"image": [64]},
                        "grids": {"image": [[1, 8, 8]]}} for i in range(256)]]}


def test_the_advisor_lays_out_experts_of_a_mixture_only(qwen3_vl_moe, qwen3_5):
    """Qwen3-VL-30B-A3B on 16 H100s: expert layouts are tried (each ep dividing the 128
    experts and the stage's tp x dp / etp), one is among the first three, and the first of
    them holds less memory than the best layout without (its all-to-all its price); their
    overrides start as the trainer takes them. A gradient reduction is paced by the bandwidth
    of the groups it runs over: a language model of 12 ranks over two 8-GPU nodes reducing
    within its pipeline stages (dp and expert dp groups inside a node) at the node's, one whose
    dp group spans the nodes at the network's. A dense model (Qwen3.5-27B) gets no expert
    layout; a mixture (35B-A3B) does."""
    from mimo_data.inspect.advice import AdvisorRequest
    from mimo_data.loading.loader import variable_token_modalities
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.planning.advisor import layouts, read_model, run_advisor
    from mimo_train.planning.advisor.candidates import expert_layouts
    config = qwen3_vl_moe["config"]
    model = read_model(str(qwen3_vl_moe["yaml"]), str(qwen3_vl_moe["preprocess"]), config,
                       QWEN3_5_MODALITIES, "bf16")
    assert (model.dims.language.experts, model.dims.language.experts_per_token) == (128, 8)
    # tp2 x dp4: etp 1; ep 2 and 4 at etp 2 (2 x ep divides 8), ep 2, 4 and 8 at etp 1
    assert expert_layouts(model, 2, 4) == [{}, {"etp": 1}, {"ep": 2}, {"ep": 2, "etp": 1},
                                           {"ep": 4}, {"ep": 4, "etp": 1}, {"ep": 8, "etp": 1}]
    request = AdvisorRequest(str(qwen3_vl_moe["yaml"]), str(qwen3_vl_moe["preprocess"]), 16,
                             gpu="h100", top=100)
    report = run_advisor(model, _moe_workload(), request, variable_token_modalities(config),
                         list(config.modalities))
    ranked = report["ranked"]
    parsed = [Layout.parse(r["layout"]).language for r in ranked]
    assert any(language.ep > 1 for language in parsed[:3]), [r["layout"] for r in ranked]
    best_dense = next(r for r, language in zip(ranked, parsed) if language.ep == 1)
    best_expert = next(r for r, language in zip(ranked, parsed) if language.ep > 1)
    assert best_expert["peak_memory_gib"] < best_dense["peak_memory_gib"]
    assert best_expert["all_to_all_s"] > 0 == best_dense["all_to_all_s"]
    import dataclasses

    from mimo_train.planning import memory
    from mimo_train.planning.advisor.cost import MFU, Advisor
    from mimo_train.planning.advisor.inputs import gpu, read_work
    device, work = gpu(request, "bf16"), read_work(model, _moe_workload())
    settings = memory.Settings(distributed_optimizer=True)
    for layout, paced_by in (("image=dp4,video;language=pp3,dp4,ep2", "node_gbs"),
                             ("image=dp4,video;language=dp12,ep4", "network_gbs")):
        sync = [Advisor(model, work, dataclasses.replace(device, **faster), MFU)._dp_sync(
            "language", Layout.parse(layout), settings)
            for faster in ({}, {"node_gbs": 2 * device.node_gbs},
                           {"network_gbs": 2 * device.network_gbs})]
        halved = 1 if paced_by == "node_gbs" else 2
        assert sync[0] > 0 and sync[halved] == pytest.approx(sync[0] / 2) and \
            sync[3 - halved] == pytest.approx(sync[0]), (layout, sync)
    for r, language in zip(ranked, parsed):
        assert 128 % language.ep == 0
        assert language.tp * language.dp % (language.expert_tp * language.ep) == 0
        assert r["layout_full"] == str(Layout.parse(r["layout"]))
        cfg = TrainConfig.load(str(qwen3_vl_moe["yaml"]), r["overrides"])
        assert Layout.parse(cfg.layout).language == Layout.parse(r["layout_full"]).language
        resolve(cfg)                     # the trainer's start-up: raises what it refuses
    # the candidates of a dense model and of a mixture (Qwen3.5, 16 GPUs)
    preprocessing = qwen3_5["config"]
    found = {name: layouts(_qwen3_5_model(qwen3_5, name), 16, QWEN3_5_MODALITIES, 128, 8,
                           variable_token_modalities(preprocessing),
                           list(preprocessing.modalities)) for name in ("27B", "35B-A3B")}
    assert found["27B"] and not any(x.language.expert_fields for x in found["27B"])
    assert any(x.language.ep > 1 for x in found["35B-A3B"])


# ------------------------------------------------------------------ LoRA adapters

def test_lora_adapters_per_rank_by_hand():
    """A LoRA adapter is r·(in + out) per adapted layer: split over tp, a routed expert's over
    etp on the expert-parallel rank holding it; trained as any weight (18 bytes in bf16, the
    distributed optimizer's 12 ÷ dp, the experts' ÷ expert dp)."""
    from mimo_train.planning.adapters import LanguageAdapters, language_adapters
    # linear_qkv 64 -> 192 at rank 4: 4 x 256 = 1024 a layer, 512 a rank at tp2, one layer a
    # stage at pp2
    qkv = language_adapters(MOE, 4, ("linear_qkv",))
    assert qkv == LanguageAdapters((1024, 1024), ())
    assert qkv.rank_parameters(MOE, tp=2) == (1024, 0.0)
    assert qkv.rank_parameters(MOE, tp=2, pp=2, stage=1) == (512, 0.0)
    # linear_fc1 reaches every routed expert (gate and up: 64 -> 64) at rank 2: 2 x 128 = 256
    # each, 8 a layer; tp2 ep4 etp1: 2 experts a layer, 2 layers: 1024; etp (tp) 2: 512
    fc1 = language_adapters(MOE, 2, ("linear_fc1",))
    assert fc1 == LanguageAdapters((0, 0), ((256,) * 8,) * 2) and fc1.parameters == 4096
    assert fc1.rank_parameters(MOE, tp=2, ep=4, etp=1) == (0.0, 1024)
    assert fc1.rank_parameters(MOE, tp=2, ep=4) == (0.0, 512)
    # all-linear leaves the routed experts out, as PEFT's: the attention's 4 x (256 + 128)
    assert language_adapters(MOE, 4, ("all-linear",)) == LanguageAdapters((1536, 1536), ())
    # one expert's linear_fc2 (32 -> 64): on the fullest expert-parallel rank, the one holding
    # expert 7 (ep4: experts 6 and 7), of pipeline stage 1
    one = language_adapters(MOE, 2, ("decoder.layers.1.mlp.experts.local_experts.7.linear_fc2",))
    assert one.rank_parameters(MOE, pp=2, stage=0, ep=4, etp=1) == (0.0, 0)
    assert one.rank_parameters(MOE, pp=2, stage=1, ep=4, etp=1) == (0.0, 192)
    # the distributed optimizer over dp 4 (the dense ones) and expert dp 2: 2 + 4 + 3 and
    # 2 + 4 + 6 bytes
    dist = mem.Settings("bf16", distributed_optimizer=True)
    assert mem.adapter_state_bytes(512, 1024, dist, dp=4, expert_dp=2) == \
        mem.Memory(adapters=9 * 512 + 12 * 1024)
    assert mem.adapter_state_bytes(512, 1024, mem.Settings("bf16")).total == 18 * 1536


# Published encoder dims as their config.json gives them, typed in (tools/published holds no
# Whisper or SigLIP checkpoint): openai/whisper-large-v3's encoder, and the vision tower of
# google/siglip-so400m-patch14-384 with its pooling head (vision_use_head, as published)
WHISPER_LARGE_V3 = {"model_type": "whisper", "d_model": 1280, "encoder_layers": 32,
                    "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "num_mel_bins": 128,
                    "max_source_positions": 1500}
SIGLIP_SO400M = {"model_type": "siglip_vision_model", "hidden_size": 1152,
                 "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
                 "image_size": 384, "patch_size": 14, "vision_use_head": True}


# per layer, all-linear: q, k, v, out_proj d -> d, 4 x 2d; fc1 d -> ffn and fc2 ffn -> d,
# 2 x (d + ffn) (Whisper's k_proj has no bias, which LoRA does not count); q_proj, fc2:
# 2d + (d + ffn)
@pytest.mark.parametrize("kind, config, all_linear, q_fc2", [
    # 32 layers, d 1280, ffn 5120
    ("whisper", WHISPER_LARGE_V3, 32 * (4 * 2560 + 2 * 6400), 32 * (2560 + 6400)),
    # 27 layers, d 1152, ffn 4304; no pooling head (its attention's out_proj, its mlp.fc2)
    ("siglip", SIGLIP_SO400M, 27 * (4 * 2304 + 2 * 5456), 27 * (2304 + 5456)),
    # CLIP ViT-L/14-336, d 1024, ffn 4096: vision_feature_layer -2 of hidden states 0..24
    # (0 the embeddings) is the 23rd layer's output, so 23 of its 24 layers; CLIPVisionModel
    # has no visual_projection (projection_dim 768)
    ("llava", "llava-hf--llava-1.5-7b-hf", 23 * (4 * 2048 + 2 * 5120), 23 * (2048 + 5120)),
    # SigLIP so400m as LLaVA-interleave holds it: 26 layers, vision_feature_layer -1 reads all
    ("llava", "llava-hf--llava-interleave-qwen-0.5b-hf", 26 * (4 * 2304 + 2 * 5456),
     26 * (2304 + 5456))],
    ids=["whisper-large-v3", "siglip-so400m", "llava-1.5-7b", "llava-interleave-0.5b"])
def test_encoder_tower_adapters_by_hand(kind, config, all_linear, q_fc2, tmp_path):
    """The advisor's LoRA adapters on an encoder's tower (``planning.adapters``: the linear
    layers of the tower its family builds, on the meta device) against a hand count from the
    published configs' dims, r·(in + out) per adapted layer, at rank 8 on ``all-linear`` and
    on ``q_proj`` and ``fc2``: the Whisper, SigLIP and LLaVA towers (CLIP's and SigLIP's),
    which the trainer's own count (Qwen3.5's tower, below) does not reach. A layer the
    encoder drops counted (SigLIP's pooling head, CLIP's last layer past the one LLaVA
    reads), or a layer of the family's tower left out, changes the count."""
    from mimo_train.planning.adapters import encoder_adapters
    if isinstance(config, dict):
        (tmp_path / "config.json").write_text(json.dumps(config))
        path = tmp_path
    else:
        path = REPO / "tools" / "published" / config
    setting = SimpleNamespace(kind=kind, spec=SimpleNamespace(pretrained=str(path)))
    assert encoder_adapters(setting, (), "encoder", 8, ("all-linear",)) == 8 * all_linear
    assert encoder_adapters(setting, (), "encoder", 8, ("q_proj", "fc2")) == 8 * q_fc2


# Qwen3-VL-30B-A3B with rank 16 on every routed expert: 48 layers x 128 experts x 16 x (2048 +
# 1536, gate and up; 768 + 2048, down)
QWEN3_VL_30B_EXPERT_ADAPTERS = 48 * 128 * 16 * (2048 + 1536 + 768 + 2048)


def test_the_advisor_counts_the_routed_experts_adapters(qwen3_vl_moe, tmp_path):
    """Qwen3-VL-30B-A3B with LoRA rank 16 on every routed expert (``*.local_experts.*``):
    629M adapter parameters, 10.5 GiB a rank at ep 1 without the distributed optimizer (what
    the advisor left out before). On 8 H100s every ranked layout's fullest rank holds its
    layout's share by hand (÷ ep x etp; the distributed optimizer's 12 bytes ÷ expert dp), the
    text report names them, and a rank out of memory is offered the distributed optimizer
    for them."""
    from mimo_data.inspect.advice import AdvisorRequest
    from mimo_data.loading.loader import variable_token_modalities
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.planning.advisor import read_model, run_advisor
    from mimo_train.planning.advisor.report import format_report
    from mimo_train.planning.memory_remedies import memory_remedies
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(TrainConfig.load(str(qwen3_vl_moe["yaml"]), [
        "model.lora={language: {rank: 16, targets: ['*.local_experts.*']}}",
        "train.precision=bf16"]).to_dict()))
    config = qwen3_vl_moe["config"]
    model = read_model(str(path), str(qwen3_vl_moe["preprocess"]), config,
                       QWEN3_5_MODALITIES, "bf16")
    assert model.adapters.parameters() == {"language": QWEN3_VL_30B_EXPERT_ADAPTERS}
    assert QWEN3_VL_30B_EXPERT_ADAPTERS == 629_145_600
    assert 18 * QWEN3_VL_30B_EXPERT_ADAPTERS / 2**30 == pytest.approx(10.55, abs=0.01)
    request = AdvisorRequest(str(path), str(qwen3_vl_moe["preprocess"]), 8, gpu="h100",
                             top=100)
    report = run_advisor(model, _moe_workload(), request, variable_token_modalities(config),
                         list(config.modalities))
    assert report["ranked"]
    for r in report["ranked"]:
        language = Layout.parse(r["layout_full"]).language
        if 48 % language.pp:
            continue
        held = QWEN3_VL_30B_EXPERT_ADAPTERS / (language.pp * language.ep * language.expert_tp)
        optimizer = 12 / (language.expert_dp if r["settings"]["distributed_optimizer"] else 1)
        adapters = sum(m["adapters"] for name, m in r["memory_gib"].items()
                       if "language" in name.split("+"))
        assert adapters == pytest.approx(held * (6 + optimizer) / 2**30), r["layout_full"]
    text = format_report(report)
    assert "(LoRA adapters: language 0.63B)" in text
    assert "LoRA adapters " in text.split("why")[1]
    # a rank of language dp8 (ep 1) out of memory: the adapters' 7.0 GiB of Adam state split
    plan = resolve(TrainConfig.load(str(path), ["layout=language=dp8;image=dp8,off0,video"]))
    offered = memory_remedies(plan, plan.layout.role(0).modules)
    assert "optimizer.modules.language.distributed=true (the LoRA adapters' optimizer state, " \
        "7.0 GiB on this rank, split over its 8 expert DP ranks)" in offered, offered


def test_lora_adapters_are_what_the_trainer_allocates(qwen3_5, tmp_path):
    """The advisor's adapter bytes of one rank against the trainer's own model and optimizer
    (``model.build``, ``components.optimizer``; in process, a one-rank gloo world, bf16): the
    published Qwen3.5-35B-A3B replica (three gated delta-net layers and a gated attention
    layer; 8 experts of 24 and a shared expert of 32) with adapters on the delta-nets'
    ``in_proj`` and ``out_proj``, the attention's ``linear_qkv``, the shared and every routed
    expert's ``linear_fc1`` and ``linear_fc2`` (rank 4), and on the image module's
    ``linear_fc1`` (its tower's blocks' and merger's) and its second block's ``attn.qkv`` by
    its path from the module (rank 2): each module's trained parameters
    (adapters alone) are the advisor's count, and the bytes megatron-core holds for them, the
    adapters' bf16 weights, DDP's fp32 gradient buffers and the optimizer's fp32 main weights
    and Adam moments (after one step), the advisor's ``Memory.adapters``."""
    import torch

    from mimo_data.preprocess.chat_tokens import TextEncoder
    from mimo_train.components.optimizer import build_optimizer
    from mimo_train.config import TrainConfig
    from mimo_train.mcore.attention import available, choose
    from mimo_train.mcore.grids import build_infra
    from mimo_train.model.build import build_model
    from mimo_train.model.lora import is_adapter
    from mimo_train.plan import resolve
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, read_model, read_work
    from mimo_train.runtime import distributed
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(TrainConfig.load(None, [
        f"data.datasets=[{tmp_path}]", f"data.preprocess={qwen3_5['preprocess']}",
        f"model.pretrained={MODELS / 'published' / 'Qwen--Qwen3.5-35B-A3B'}",
        "layout=language=dp1;image=dp1,off0,video", "train.precision=bf16",
        "model.lora={language: {rank: 4, targets: [in_proj, out_proj, linear_qkv, linear_fc1, "
        "linear_fc2]}, image: {rank: 2, targets: [linear_fc1, "
        "encoders.image.encoder.model.blocks.1.attn.qkv]}}"]).to_dict()))
    config = qwen3_5["config"]
    model = read_model(str(path), str(qwen3_5["preprocess"]), config, QWEN3_5_MODALITIES,
                       "bf16")
    workload = {**_qwen3_5_workload(), "global_batch_size": 8, "micro_batch_size": 8}
    workload["steps"] = [workload["steps"][0][:8]]
    advisor = Advisor(model, read_work(model, workload), GPU("cpu", 1e6, 1.0, 1.0, 1.0))
    layout = Layout.parse("language=dp1;image=dp1,off0,video")
    (predicted,) = advisor.evaluate(Candidate(layout, mem.Settings("bf16"))).memory.values()

    cfg = TrainConfig.load(str(path), [])
    plan, text = resolve(cfg, config), TextEncoder(config)
    cpu = torch.device("cpu")
    with distributed.alone():
        infra = build_infra(plan.layout, "gloo")
        built = build_model(plan, infra, plan.language.vocabulary(text.vocab_size),
                            text.modality_token_ids, cpu,
                            choose(cfg.model.attention, torch.bfloat16, available(cpu)))
        optimizer = build_optimizer(cfg.optimizer, plan.modules, "bf16", built)
        modules = {"language": built.language_model,
                   "image": built.modality_submodules["image"]}
        for ddp in modules.values():
            ddp.zero_grad_buffer()
        optimizer.zero_grad()
        assert optimizer.step()[0]              # Adam's moments made
        held = 0
        for name, ddp in modules.items():
            trained = {key: p for key, p in ddp.named_parameters() if p.requires_grad}
            assert trained and all(is_adapter(key) for key in trained), name
            assert sum(p.numel() for p in trained.values()) == \
                model.adapters.parameters()[name], name
            held += sum(p.numel() * p.element_size() for p in trained.values())
            held += sum(b.grad_data.numel() * b.grad_data.element_size()
                        for b in (*ddp.buffers, *ddp.expert_parallel_buffers))
        for info in optimizer.module_infos.values():
            for inner in info.optimizer.chained_optimizers:
                adam = inner.optimizer
                for group in adam.param_groups:
                    for main in group["params"]:           # fp32 main weights, their moments
                        held += main.numel() * main.element_size()
                        held += sum(v.numel() * v.element_size()
                                    for k, v in adam.state[main].items() if k != "step")
    # by hand, rank 4: a delta-net layer's in_proj 64 -> 200 (q, k 32 each, v, z 64 each, beta
    # and alpha 4 each) 1056, out_proj 64 -> 64 512, three of them; the attention's linear_qkv
    # 64 -> 768 (queries and their gates 2 x 256, keys and values 2 x 128) 3328; each layer's
    # shared expert 64 -> 64, 32 -> 64: 896, and 8 routed experts 64 -> 48, 24 -> 64: 8 x 800;
    # rank 2: the blocks' linear_fc1 32 -> 48 2 x 160, the merger's 128 -> 128 512, the second
    # block's attn.qkv 32 -> 96 256
    assert 3 * 1568 + 3328 + 4 * (896 + 8 * 800) == 37216 and 320 + 512 + 256 == 1088
    assert model.adapters.parameters() == {"language": 37216, "image": 1088}
    assert predicted.adapters == held == 18 * (37216 + 1088)


# ------------------------------------------------------------------ context parallelism

def test_context_parallel_memory_and_traffic_by_hand():
    """cp2 keeps half the language activations (the scores' and the hidden states' gradient
    too) and the same weights and gradients; the distributed optimizer shards over dp x cp;
    one layer's all-to-all bytes."""
    from mimo_train.planning.advisor.cost import context_traffic
    bf16 = mem.Settings("bf16", attention_scores=True)
    lengths = [100, 60]
    one = mem.language_activation_bytes(STACK, lengths, bf16, tp=2, pp=1)
    two = mem.language_activation_bytes(STACK, lengths, bf16, tp=2, pp=1, cp=2)
    assert two == pytest.approx(one / 2) and two < one
    # a rank's 80 positions' trained tokens' logits in bf16 and fp32 (of 120 trained: at most
    # 80 on one rank), larger than the output's weight gradient beside their bf16 gradient
    assert mem.language_temporary_bytes(STACK, 160, 120, bf16, tp=2, cp=2) == pytest.approx(
        80 * 128 / 2 * 6)
    dist = mem.Settings("bf16", distributed_optimizer=True)
    cp1 = mem.language_state_bytes(STACK, dist, tp=2, dp=2)
    cp2 = mem.language_state_bytes(STACK, dist, tp=2, dp=2 * 2)     # dp2 x cp2
    assert (cp2.weights, cp2.gradients) == (cp1.weights, cp1.gradients)
    assert cp2.optimizer == pytest.approx(cp1.optimizer / 2)
    # 100 positions at tp1 cp2 in bf16: each rank's 50, heads 4 x 16 channels; q, out and k,
    # v (4 groups), forward and backward, half of each to the other rank:
    # 2 x (2 x 4 + 2 x 4) x 16 x 50 x 1/2 x 2 bytes = 25600
    assert context_traffic(STACK, 100, 2, tp=1, cp=2) == 25600
    assert context_traffic(STACK, 100, 2, tp=1, cp=1) == 0
    # GQA: 2 groups over cp4 are repeated to 4 (a multiple of 4 dividing the 4 heads)
    gqa = Stack(layers=2, hidden=64, heads=4, query_groups=2, kv_channels=16, ffn_hidden=256,
                gated=False, vocab=128)
    assert context_traffic(gqa, 100, 2, cp=4) == 2 * (8 + 8) * 16 * 25 * 3 / 4 * 2


@pytest.fixture(scope="module")
def qwen2_vl_2b(tmp_path_factory) -> dict:
    """Qwen2-VL-2B-Instruct's published config.json (tools/published: 28 layers of 1536, 12
    heads in 2 query groups: tp2 at most) with the family's preprocessing (the replica's)."""
    from mimo_data.loading.loader import variable_token_modalities
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.families.registry import preprocessing_for
    from mimo_train.planning.advisor import read_model
    tmp = tmp_path_factory.mktemp("qwen2_vl_2b")
    preprocess = tmp / "preprocess.yaml"
    preprocess.write_text(yaml.safe_dump(
        preprocessing_for(str(MODELS / "published" / "Qwen--Qwen2-VL-2B-Instruct"))))
    config = PreprocessConfig.from_yaml(str(preprocess))
    checkpoint = REPO / "tools" / "published" / "Qwen--Qwen2-VL-2B-Instruct"
    model = read_model(str(checkpoint), str(preprocess), config, QWEN3_5_MODALITIES, "bf16")
    return {"model": model, "preprocess": preprocess, "checkpoint": checkpoint,
            "variable": variable_token_modalities(config), "expanded": list(config.modalities)}


def _long_advice(qwen2_vl_2b, tokens: int, batch: int, fewer: bool) -> list[Layout]:
    from mimo_data.inspect.advice import AdvisorRequest
    from mimo_train.planning.advisor import run_advisor
    workload = {"global_batch_size": batch, "micro_batch_size": 1, "seq_length": tokens,
                "packing": False, "epochs": 1, "vocab_size": 151_700,
                "modalities": QWEN3_5_MODALITIES,
                "steps": [[{"tokens": tokens, "trained": tokens, "items": {"image": [16]},
                            "grids": {"image": [[1, 4, 4]]}}] * batch]}
    request = AdvisorRequest(str(qwen2_vl_2b["checkpoint"]), str(qwen2_vl_2b["preprocess"]),
                             8, gpu="h100", top=100, fewer_gpus=fewer)
    report = run_advisor(qwen2_vl_2b["model"], workload, request, qwen2_vl_2b["variable"],
                         qwen2_vl_2b["expanded"])
    return [Layout.parse(r["layout_full"]) for r in report["ranked"]]


def test_the_advisor_takes_context_parallelism_for_a_long_sequence_only(qwen2_vl_2b):
    """Qwen2-VL-2B on 8 H100s: one sample of 131072 tokens fits no layout at cp1 (the cross
    entropy's fp32 softmax alone, ÷ tp2 at most, is 37 GiB, the logits' bf16 gradient 19
    more), and some at cp>1
    (the tower on a rank of its own, fewer GPUs allowed); 8 samples of 2048 tokens rank a cp1
    layout first, faster than any with cp."""
    long = _long_advice(qwen2_vl_2b, 131072, 1, True)
    assert long and all(layout.language.cp > 1 for layout in long), long
    for layout in long:                         # cp divides each TP rank's heads
        assert (12 // layout.language.tp) % layout.language.cp == 0
    short = _long_advice(qwen2_vl_2b, 2048, 8, False)
    assert short and short[0].language.cp == 1, short


def test_the_clip_workload_s_tokens_are_the_qwen_rule(capsys, tmp_path):
    """``--clip-seconds 60 --fps 2 --clip-size 448x448``: 120 frames, in temporal patches of
    2, each (448 / patch / 2)² tokens (no resize: 448 is a multiple of patch x merge, within
    the pixel bounds); the sample adds the chat template, the wraps and (Qwen3-VL) a timestamp
    text per temporal patch. The command prints the clip and ranks layouts for it."""
    from mimo_data.inspect.clip import clip_workload
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.families.registry import preprocessing_for
    from mimo_train.inspect_cli import main
    for name, patch, per_patch_text in (("Qwen--Qwen2-VL-2B-Instruct", 14, 0),
                                        ("Qwen--Qwen3-VL-2B-Instruct", 16, 2)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(preprocessing_for(str(MODELS / "published" / name))))
        config = PreprocessConfig.from_yaml(str(path))
        work = clip_workload(config, 60, 2, (448, 448))
        temporal = 60 * 2 // 2
        video = temporal * (448 // patch // 2) ** 2
        sample = work["steps"][0][0]
        assert sample["items"] == {"video": [video]}
        assert work["clip"]["grid"] == [temporal, 448 // patch // 2, 448 // patch // 2]
        # the wraps (2 a temporal patch with timestamps, else 2) and a timestamp text of a
        # few tokens a patch, the template and prompt under 64
        low = video + 2 + per_patch_text * temporal
        assert low <= sample["tokens"] <= low + 8 * per_patch_text * temporal + 64
        assert work["seq_length"] == sample["tokens"] and work["global_batch_size"] == 1
    code, out, err = _run(capsys, main, "plan", "--config", path, "--model",
                          MODELS / "published" / "Qwen--Qwen3-VL-2B-Instruct", "--gpus", 2,
                          "--clip-seconds", 60, "--fps", 2, "--clip-size", "448x448")
    assert code == 0, err
    assert f"= {video} video tokens" in out and "layouts" in out and "on 1 to 2 GPUs" in out
    assert "as written" not in out and "drops clips" not in out
    # one clip a step, counted under the module that takes it (a Qwen tower's "image")
    assert "1 step of 1 sample (micro batch 1)" in out and \
        "items per step by encoder module: image 1.0" in out, out
    # a config that would sample fewer frames, and drop the clip: said beside the figures,
    # which stay every frame's
    capped = yaml.safe_load(path.read_text())
    capped["modalities"]["video"].update(max_frames=100, max_duration=30)
    (tmp_path / "capped.yaml").write_text(yaml.safe_dump(capped))
    code, out, err = _run(capsys, main, "plan", "--config", tmp_path / "capped.yaml", "--model",
                          MODELS / "published" / "Qwen--Qwen3-VL-2B-Instruct", "--gpus", 2,
                          "--clip-seconds", 60, "--fps", 2, "--clip-size", "448x448")
    assert code == 0, err
    assert f"= {video} video tokens" in out
    assert ("the preprocessing config as written samples 100 of them (modalities.video."
            "max_frames 100): set max_frames to 120 to train every frame") in out
    assert "it drops clips over 30 s (modalities.video.max_duration): raise it" in out
    code, out, err = _run(capsys, main, "plan", "DIR", "--config", path, "--model", path,
                          "--gpus", 2, "--clip-seconds", 60)
    assert code == 2 and "drop DIR" in err
    # --fps is the frames a second the encoder sees: too few for one temporal patch, said so
    code, out, err = _run(capsys, main, "plan", "--config", path, "--model", MODELS /
                          "published" / "Qwen--Qwen3-VL-2B-Instruct", "--gpus", 2,
                          "--clip-seconds", 60, "--fps", 0.01)
    assert code == 2 and "--clip-seconds 60 at --fps 0.01 (the frames a second the encoder " \
        "sees) is 1 frame(s), fewer than one temporal patch (2 frames)" in err, err


def test_a_packed_clip_plan_ranks_only_what_a_packed_run_takes(capsys, tmp_path):
    """``--clip-seconds`` with ``--packing`` (Qwen3.5-35B-A3B on 16 GPUs, a 5-minute clip):
    the workload is packed, so no layout needs sequence parallelism (which packing does not
    run with) and each command line packs; unpacked, tp2 with sequence parallelism leads."""
    from mimo_train.families.registry import preprocessing_for
    from mimo_train.inspect_cli import main
    model = MODELS / "published" / "Qwen--Qwen3.5-35B-A3B"
    path = tmp_path / "preprocess.yaml"
    path.write_text(yaml.safe_dump(preprocessing_for(str(model))))
    ranked = {}
    for packing in (False, True):
        code, out, err = _run(capsys, main, "plan", "--config", path, "--model", model,
                              "--gpus", 16, "--clip-seconds", 300, "--fps", 2, "--json",
                              *(["--packing"] if packing else []))
        assert code == 0, err
        report = json.loads(out)
        assert report["workload"]["packing"] is packing and report["ranked"]
        ranked[packing] = report["ranked"]
        # beside the top five, the best of up to three language layouts they lack, in rank
        # order (the top can be one language layout beside towers of other sizes)
        others = report["other_language_layouts"]

        def language(r: dict) -> str:
            return next(p for p in r["layout"].split(";") if p.startswith("language="))
        shown = {language(r) for r in report["ranked"]}
        assert 0 < len(others) <= 3 and len({language(r) for r in others}) == len(others)
        assert not shown & {language(r) for r in others}
        assert [r["rank"] for r in others] == sorted(r["rank"] for r in others)
        assert others[0]["rank"] > report["ranked"][-1]["rank"]
    assert ranked[False][0]["settings"]["sequence_parallel"]
    assert not any("data.packing=true" in r["overrides"] for r in ranked[False])
    assert not any(r["settings"]["sequence_parallel"] for r in ranked[True])
    assert all("data.packing=true" in r["overrides"] and
               "model.language.sequence_parallel=false" in r["overrides"] for r in ranked[True])


# ------------------------------------------------------- split media, the tower's recompute

def test_split_media_divides_the_tower_s_activations_by_k():
    """``data.split_media``: a clip of 30 temporal patches cut over k = 2 and 3 encoder ranks
    as the loader cuts it (between temporal patches, near-equal tokens), each rank's tower
    activations 1/k of the whole clip's (t / k patches each: the per-frame squares divide
    too), an image beside it kept whole; the parts add up to the micro-batch's."""
    from mimo_train.planning.dims import Linear, Tower
    tower = Tower("qwen2_vl", Stack(layers=2, hidden=64, heads=4, query_groups=4,
                                    kv_channels=16, ffn_hidden=256, gated=False),
                  (Linear(3 * 2 * 14 * 14, 64),), 64, merge=2)
    settings = mem.Settings("bf16")
    clip = [30, 8, 12]
    whole = mem.tower_activation_bytes(tower, [clip], settings)
    for k in (2, 3):
        parts = mem.split_grids([clip], k)
        assert [grid for part in parts for _, grid in part] == [[30 // k, 8, 12]] * k
        for part in parts:
            assert mem.tower_activation_bytes(tower, [g for _, g in part], settings) == \
                pytest.approx(whole / k, rel=1e-12)
    # an image (one unit) and a clip: cut inside the clip only, tokens within a patch
    parts = mem.split_grids([[1, 8, 8], [11, 8, 8]], 2)
    assert parts == [[(0, [1, 8, 8]), (1, [5, 8, 8])], [(1, [6, 8, 8])]]
    assert mem.split_grids([], 2) == [[], []]


@pytest.fixture(scope="module")
def qwen2_vl_2b_yaml(qwen2_vl_2b, tmp_path_factory) -> dict:
    """Qwen2-VL-2B (``qwen2_vl_2b``) as a training YAML, packed, micro-batches of 2: with
    ``data.split_media`` false and true."""
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.config import TrainConfig
    tmp = tmp_path_factory.mktemp("qwen2_vl_2b_yaml")
    paths = {}
    for split in (False, True):
        paths[split] = tmp / f"split-{split}.yaml"
        paths[split].write_text(yaml.safe_dump(TrainConfig.load(None, [
            f"data.datasets=[{tmp}]", f"data.preprocess={qwen2_vl_2b['preprocess']}",
            f"model.pretrained={qwen2_vl_2b['checkpoint']}", "data.packing=true",
            f"data.split_media={str(split).lower()}", "train.global_batch_size=2",
            "train.micro_batch_size=2"]).to_dict()))
    return {**qwen2_vl_2b, "yaml": paths,
            "config": PreprocessConfig.from_yaml(str(qwen2_vl_2b["preprocess"]))}


def test_a_layout_plan_of_a_split_media_run_says_it_is_taken_not_drawn(capsys, loader_corpus,
                                                                        qwen2_vl_2b_yaml):
    """``plan --layout L --model TRAIN.yaml`` of a run with ``data.split_media: true``: the
    trainer's rules take the layout (its tower ranks split each language rank's media), so
    it is not called invalid (exit 2) by the whole-sample check of a micro-batch of one; the
    per-rank plan, which draws whole samples to each encoder rank, is not drawn for it (exit
    0, saying so: in JSON with ``--json``); a DIR that is no dataset is still refused."""
    from mimo_train.inspect_cli import main
    layout, path = "image=dp2,video;language=tp2", qwen2_vl_2b_yaml["yaml"][True]
    one = path.with_name("split-one.yaml")       # micro-batches of one: a sample a language rank
    one.write_text(path.read_text().replace("micro_batch_size: 2", "micro_batch_size: 1"))
    argv = ["--config", str(qwen2_vl_2b_yaml["preprocess"]), "--model", str(one), "--layout",
            layout, "--no-progress"]
    capsys.readouterr()
    code = main(["plan", str(loader_corpus), *argv])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith(
        f"layout    {layout}: mimo-train takes it for --model {one}, which trains with "
        "data.split_media: true"), (out, err)
    code = main(["plan", str(loader_corpus), *argv, "--json"])
    out, err = capsys.readouterr()
    from mimo_data.loading.layout import Layout
    assert code == 0 and {k: v for k, v in json.loads(out).items() if k != "why"} == {
        "layout": str(Layout.parse(layout)), "valid": True, "split_media": True,
        "drawn": False}, (out, err)         # in full, as a plan's JSON names a layout
    code = main(["plan", str(path.parent / "no-dataset"), *argv])
    out, err = capsys.readouterr()
    assert code != 0 and "no-dataset" in err and not out, (code, out, err)


def _one_long_clip(clip: list[int]) -> dict:
    """One packed micro-batch of two samples: a clip of ``clip`` (t, h, w) placeholders and
    100 tokens of text, and 200 tokens of text alone."""
    tokens = clip[0] * clip[1] * clip[2]
    return {"global_batch_size": 2, "micro_batch_size": 2, "seq_length": tokens + 100,
            "packing": True, "epochs": 1, "vocab_size": 151_700,
            "modalities": QWEN3_5_MODALITIES,
            "steps": [[{"tokens": tokens + 100, "trained": tokens + 100,
                        "items": {"video": [tokens]}, "grids": {"video": [clip]}},
                       {"tokens": 200, "trained": 200, "items": {}}]]}


def test_the_advisor_splits_a_clip_that_does_not_fit_one_tower_rank(qwen2_vl_2b_yaml):
    """Qwen2-VL-2B on up to 4 H100s, a micro-batch of a 14400-token clip (57600 patches)
    and a text-only sample: whole samples put the clip on one tower rank, whose activations
    do not fit; with ``data.split_media`` each of the two tower ranks of
    ``image=dp2,video;language=tp2`` holds half of them and fits. The advisor proposes split
    media (asked by --split-media, by --clip-seconds' both, or by the YAML's
    data.split_media: true), never without fan-in, and each proposal's overrides are ones
    the trainer takes."""
    from mimo_data.inspect.advice import AdvisorRequest
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, read_model, read_work
    from mimo_train.planning.advisor import run_advisor
    config, workload = qwen2_vl_2b_yaml["config"], _one_long_clip([36, 20, 20])
    for split, asked in ((False, "no"), (False, "both"), (False, "yes"), (True, "no")):
        path = qwen2_vl_2b_yaml["yaml"][split]
        model = read_model(str(path), str(qwen2_vl_2b_yaml["preprocess"]), config,
                           QWEN3_5_MODALITIES, "bf16")
        assert model.split_media is split
        request = AdvisorRequest(str(path), str(qwen2_vl_2b_yaml["preprocess"]), 4,
                                 gpu="h100", top=100, fewer_gpus=True, split_media=asked)
        report = run_advisor(model, workload, request, qwen2_vl_2b_yaml["variable"],
                             qwen2_vl_2b_yaml["expanded"])
        ranked = report["ranked"]
        if not split and asked == "no":         # not asked: whole samples, as before
            assert not any(r["settings"]["split_media"] for r in ranked)
            assert not any("data.split_media" in o for r in ranked for o in r["overrides"])
            continue
        assert ranked and ranked[0]["settings"]["split_media"], [
            (r["layout"], r["settings"]) for r in ranked]
        for r in ranked:
            layout = Layout.parse(r["layout_full"])
            if r["settings"]["split_media"]:
                assert layout.module("image").dp > layout.language.dp
                assert not layout.colocated and "data.split_media=true" in r["overrides"]
            cfg = TrainConfig.load(str(path), r["overrides"])
            assert cfg.data.split_media is r["settings"]["split_media"]
            resolve(cfg)                # the trainer's start-up: raises what it refuses
            layout.validate(layout.world_size, 2, 2, qwen2_vl_2b_yaml["variable"],
                            modalities=qwen2_vl_2b_yaml["expanded"],
                            split_media=r["settings"]["split_media"])
    # the same layout whole and split: the tower rank's activations halve, only split fits
    advisor = Advisor(model, read_work(model, workload),
                      GPU("H100 80GB", 79.6, 989.0, 300.0, 40.0))
    layout = Layout.parse("image=dp2,video;language=tp2")
    whole, split_ = (advisor.evaluate(Candidate(layout, mem.Settings(split_media=s)))
                     for s in (False, True))
    assert not whole.fits and split_.fits
    assert split_.memory["image"].activations == \
        pytest.approx(whole.memory["image"].activations / 2, rel=1e-9)
    # half the encoding, the same gradient reduction
    assert whole.busy["image"] / 2 < split_.busy["image"] < 0.55 * whole.busy["image"]


def test_one_clip_a_micro_batch_is_split_over_more_tower_ranks_than_samples(qwen2_vl_2b_yaml):
    """The clip alone in its micro-batch (micro batch 1): whole samples give the tower one
    rank (its dp must divide the global micro-batch); split, the tower's dp need not divide
    it (each rank reads the language rank's sample), so the advisor also ranks layouts whose
    tower ranks outnumber the samples, only with split media, and the trainer takes them."""
    from mimo_data.inspect.advice import AdvisorRequest
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.planning.advisor import read_model, run_advisor
    workload = _one_long_clip([30, 20, 20])
    workload.update(global_batch_size=1, micro_batch_size=1, steps=[workload["steps"][0][:1]])
    path = qwen2_vl_2b_yaml["yaml"][False]
    model = read_model(str(path), str(qwen2_vl_2b_yaml["preprocess"]),
                       qwen2_vl_2b_yaml["config"], QWEN3_5_MODALITIES, "bf16")
    reports = {asked: run_advisor(model, workload, AdvisorRequest(
        str(path), str(qwen2_vl_2b_yaml["preprocess"]), 4, gpu="h100", top=100,
        fewer_gpus=True, split_media=asked), qwen2_vl_2b_yaml["variable"],
        qwen2_vl_2b_yaml["expanded"]) for asked in ("no", "yes")}
    for r in reports["no"]["ranked"]:
        assert Layout.parse(r["layout_full"]).module("image").dp == 1, r["layout"]
        assert not r["settings"]["split_media"]
    ranked = [r for r in reports["yes"]["ranked"]
              if Layout.parse(r["layout_full"]).module("image").dp > 1]
    assert ranked, [r["layout"] for r in reports["yes"]["ranked"]]
    for r in ranked:
        layout = Layout.parse(r["layout_full"])
        assert r["settings"]["split_media"] and layout.language.dp == 1
        resolve(TrainConfig.load(str(path), [*r["overrides"], "train.global_batch_size=1",
                                             "train.micro_batch_size=1"]))
        layout.validate(layout.world_size, 1, 1, qwen2_vl_2b_yaml["variable"],
                        modalities=qwen2_vl_2b_yaml["expanded"], split_media=True)


QWEN3_VL_8B = REPO / "tools" / "published" / "Qwen--Qwen3-VL-8B-Instruct"


def test_the_advisor_recomputes_the_tower_alone(tmp_path):
    """Qwen3-VL-8B (published dims) on 8 H100s, a 90-second clip at 2 fps of 448x448 frames
    (a config whose max_pixels is 240844800: 90 temporal patches of 196 tokens): the tower,
    whole on its one rank, keeps 69 GiB of activations and does not fit; the language
    model's full recompute, which would recompute the tower too, is refused (deepstack), so
    every layout ranked recomputes the tower alone (model.encoders.image.recompute=full,
    model.language.recompute none) or cuts the clip over several tower ranks (split media),
    the former ranked, and the trainer takes their overrides."""
    from mimo_data.inspect.advice import AdvisorRequest
    from mimo_data.inspect.clip import clip_workload
    from mimo_data.loading.loader import variable_token_modalities
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.config import TrainConfig
    from mimo_train.families.registry import preprocessing_for
    from mimo_train.plan import resolve
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, read_model, read_work
    from mimo_train.planning.advisor import run_advisor
    from mimo_train.planning.advisor.candidates import settings_of
    from mimo_train.planning.advisor.report import format_report
    preprocessing = preprocessing_for(str(MODELS / "published" / "Qwen--Qwen3-VL-2B-Instruct"))
    preprocessing["modalities"]["video"]["max_pixels"] = 240844800
    path = tmp_path / "preprocess.yaml"
    path.write_text(yaml.safe_dump(preprocessing))
    config = PreprocessConfig.from_yaml(str(path))
    work = clip_workload(config, 90, 2, (448, 448))
    assert work["clip"]["grid"] == [90, 14, 14]
    model = read_model(str(QWEN3_VL_8B), str(path), config, work["modalities"])
    request = AdvisorRequest(str(QWEN3_VL_8B), str(path), 8, gpu="h100", top=100,
                             fewer_gpus=True, split_media="both")
    layout = Layout.parse("image=dp1,video;language=tp4")
    tried = settings_of(model, layout, request, work["packing"])
    assert {(s.recompute, s.towers) for s in tried} == {("none", "none"), ("none", "full")}
    advisor = Advisor(model, read_work(model, work), GPU("H100 80GB", 79.6, 989.0, 300.0, 40.0))
    whole, alone = (advisor.evaluate(Candidate(layout, s)) for s in sorted(
        (s for s in tried if not s.distributed_optimizer), key=lambda s: s.towers == "full"))
    assert whole.memory["image"].activations / 2**30 > 60 and not whole.fits
    assert alone.fits and alone.memory["image"].activations < whole.memory["image"].activations
    report = run_advisor(model, work, request, variable_token_modalities(config),
                         list(config.modalities))
    ranked = report["ranked"]
    assert ranked and all(r["settings"]["recompute"] == "none" and (
        r["settings"]["tower_recompute"] == "full" or (
            r["settings"]["split_media"]
            and Layout.parse(r["layout_full"]).module("image").dp > 1)) for r in ranked), ranked
    assert "tower recompute full" in format_report(report)
    ranked = [r for r in ranked if r["settings"]["tower_recompute"] == "full"]
    assert ranked
    for r in ranked:
        assert "model.encoders.image.recompute=full" in r["overrides"]
        cfg = TrainConfig.load(None, ["data.datasets=[unused]", f"data.preprocess={path}",
                                      f"model.pretrained={QWEN3_VL_8B}", *r["overrides"]])
        assert cfg.model.encoders["image"].recompute == "full"
        resolve(cfg)                    # the trainer's start-up: raises what it refuses


@pytest.mark.parametrize("lora, offered", [
    ("image.encoder", True),        # the projection trains whole beside the adapted tower
    ("image", False)])              # the whole module under LoRA: its adapters alone train
def test_a_module_partly_under_lora_is_offered_the_distributed_optimizer(lora, offered,
                                                                         tmp_path):
    """Out of memory on a tower rank of ``image=dp2``: where the module trains weights whole
    beside small adapters (its projection next to an adapted tower), the distributed
    optimizer for its state is offered; where LoRA holds the whole module (adapters under
    1 GiB of state), it is not."""
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.planning.memory_remedies import memory_remedies
    config = yaml.safe_load((REPO / "configs" / "train" / "qwen2_vl_lora.yaml").read_text())
    config["model"]["pretrained"] = str(REPO / "assets" / "models" / "tiny-qwen2-vl")
    config["data"]["preprocess"] = str(REPO / "configs" / "preprocess_qwen2_vl.yaml")
    config["model"]["lora"] = {lora: {"rank": 8, "alpha": 16, "targets": ["attn.qkv"]}}
    config["layout"] = "image=dp2;language=dp1"
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    plan = resolve(TrainConfig.load(str(path)))
    image = [m for m in plan.layout.role(0).modules if m.name == "image"]
    found = memory_remedies(plan, image)
    wanted = "optimizer.modules.image.distributed=true (its optimizer state split over its 2 " \
        "DP ranks)"
    assert (wanted in found) == offered, found


def test_the_plan_takes_any_spelling_of_the_run_s_one_dataset_for_it(tmp_path):
    """``plan DIR --model TRAIN.yaml``'s note that the run trains other data: not for the
    YAML's one dataset spelled otherwise (a URL's scheme case and slashes, a local link)."""
    from types import SimpleNamespace

    from mimo_data.inspect.cli import _other_data
    (tmp_path / "ds").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ds")
    for directory, theirs in (("s3://bucket/ds", "S3://bucket//ds/"),
                              (str(tmp_path / "link"), f"{tmp_path}/ds/")):
        args = SimpleNamespace(directory=directory, model="run.yaml")
        assert _other_data(args, {"data.datasets": [theirs], "data.weights": None}) is None
    args = SimpleNamespace(directory="s3://bucket/ds", model="run.yaml")
    assert _other_data(args, {"data.datasets": ["gs://bucket/ds"], "data.weights": None}) == \
        "--model run.yaml trains data.datasets gs://bucket/ds; this plan counts " \
        "s3://bucket/ds alone"
