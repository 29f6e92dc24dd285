"""Training FLOPs (``mimo_train.planning.flops``) against hand counts written out here, the
dims read from configs (``planning.dims``) against the built encoders and a published
checkpoint's config.json, Qwen2.5-VL's windows against transformers' own tiling; Qwen3.5's
hybrid layers (gated delta-net, gated attention, the shared expert) against hand counts and
against what torch's FLOP counter counts in transformers' own modules. In process, no job (the
trainer's records: ``test_train_parity.py``, ``test_train_run.py``)."""

from types import SimpleNamespace

import pytest

from conftest import REPO
from mimo_data.loading.layout import Layout
from mimo_data.modalities.audio import AudioConfig
from mimo_data.modalities.image import ImageConfig
from mimo_train.families.causal_lm import LinearAttention
from mimo_train.plan.parts import Part
from mimo_train.planning.dims import (FULL, LINEAR, Linear, Stack, Tower, projection_linears,
                                      tower_from_hf)
from mimo_train.planning.flops import (chunk_square, language_flops, layer_flops_per_token,
                                       layer_square_flops, peak_tflops, projection_flops,
                                       step_flops, tower_flops, trains, training_passes,
                                       window_sizes)

PUBLISHED = REPO / "tools" / "published" / "Qwen--Qwen2.5-VL-7B-Instruct"
# tools/make_published.py's Qwen3.5 replicas: 4 layers (3 gated delta-net, 1 gated attention)
QWEN3_5 = REPO / "assets" / "models" / "published" / "Qwen--Qwen3.5-4B"
QWEN3_5_MOE = REPO / "assets" / "models" / "published" / "Qwen--Qwen3.5-35B-A3B"

# 2 layers, h 64, 4 heads of 16, ffn 256 (GELU), 128 output rows: a random-init language model
LANGUAGE = Stack(layers=2, hidden=64, heads=4, query_groups=4, kv_channels=16, ffn_hidden=256,
                 gated=False, vocab=128)


def test_language_model_hand_count():
    # per token and layer: qkv 2·64·192 = 24576, out 2·64·64 = 8192, MLP 2·64·256·2 = 65536
    #   -> 98304; 2 layers 196608; logits 2·64·128 = 16384: 212992 per token
    # samples of 5 and 9 tokens: 14 · 212992 = 2981888
    # attention: 2 layers · 4 · 64 · (5² + 9²) = 54272 (each sample its own square)
    # forward 3036160, training (x3) 9108480
    assert language_flops(LANGUAGE, [5, 9]) == 9_108_480
    # one sample of 14 tokens has the same dense part, a larger square: 2·4·64·196 = 100352
    assert language_flops(LANGUAGE, [14]) == 3 * (2_981_888 + 100_352)
    assert language_flops(LANGUAGE, [5, 9], passes=1) == 3_036_160
    # 3 of the 14 tokens trained: the output layer's 16384 a token on those alone
    assert language_flops(LANGUAGE, [5, 9], trained=3) == 9_108_480 - 3 * 11 * 16384


def test_qwen2_vl_tower_and_projection_hand_count():
    tower = tower_from_hf("qwen2_vl", _qwen2_vl_config())
    # an image of 4 x 6 patches (14 px), merged 2 x 2 into 6 tokens; tower width 32, 2 heads,
    # MLP 64, merger 128 -> 128 -> 32, projection linear 32 -> 64:
    # patch embed 24 · 2·1176·32 = 1806336; layer 24 · (6144 + 2048 + 8192) = 393216;
    # attention 4 · 32 · 24² = 73728; merger 6 · (32768 + 8192) = 245760;
    # projection 6 · 2·32·64 = 24576. Forward 2543616, training 7630848
    projection = projection_linears("linear", 32, 64)
    assert tower_flops(tower, [(1, 4, 6)]) + projection_flops(projection, 6) == 7_630_848


def test_qwen2_5_vl_windows_and_frames_hand_count():
    # 2 layers of width 32 (2 heads), SwiGLU MLP 64, windows of 2 x 2 merged tokens but in
    # layer 1; a video of 2 frames of 6 x 10 patches (3 x 5 merged tokens a frame)
    tower = Tower("qwen2_5_vl", Stack(2, 32, 2, 2, 16, 64, gated=True),
                  (Linear(1176, 32),), 32, merge=2,
                  merger=(Linear(128, 128), Linear(128, 32)), window=2,
                  full_attention_layers=(1,))
    # windows of a frame: rows 2+1, columns 2+2+1 merged tokens -> 16 16 8 8 8 4 patches
    assert sorted(window_sizes(tower, 6, 10)) == [4, 8, 8, 8, 16, 16]
    # patch embed 120 · 75264 = 9031680; layers 120 · 2 · (6144 + 2048 + 8192 + 4096) =
    # 4915200; attention per frame 4 · 32 · (60² + 720) = 552960, 2 frames 1105920;
    # merger 30 · 40960 = 1228800. Forward 16281600, training 48844800
    assert tower_flops(tower, [(2, 6, 10)]) == 48_844_800


def test_windows_tile_as_transformers_does():
    import torch
    from transformers.vision_utils import get_vision_window_index
    tower = Tower("qwen2_5_vl", Stack(1, 32, 2, 2, 16, 64, gated=True), (), 32, merge=2,
                  window=4)                         # Qwen2.5-VL's: 112 px of 14 px, merge 2
    for h, w in [(8, 8), (6, 10), (34, 50), (16, 8), (2, 2), (18, 30)]:
        _, bounds = get_vision_window_index(torch.tensor([[1, h, w]]), 2, 112, 14)
        assert sorted(window_sizes(tower, h, w)) == sorted(torch.diff(bounds).tolist())


def test_whisper_clip_is_its_padded_window():
    from mimo_train.families.whisper import WhisperAudio
    tower = tower_from_hf("whisper", WhisperAudio.random_config(AudioConfig(), 16, 1, 2))
    # 30 s of 10 ms frames: 3000 frames, 1500 positions, whatever the clip's length
    # conv1 2 · 2·240·16 = 15360 and conv2 2·48·16 = 1536 per position: 25344000;
    # layer 1500 · (1536 + 512 + 2048) = 6144000; attention 4 · 16 · 1500² = 144000000
    # projection linear 16 -> 64 on the clip's 7 tokens: 7 · 2048 = 14336
    dims = SimpleNamespace(
        language=LANGUAGE, module_of=lambda modality: "audio" if modality == "audio" else None,
        encoders={"audio": SimpleNamespace(tower=tower,
                                           projection=projection_linears("linear", 16, 64))})
    found = step_flops(dims, [5, 9], {"audio": [[7], []]}, {"audio": [[None], []]})
    assert found == {"language": 9_108_480, "audio": 3 * (175_488_000 + 14_336)}


def parts(*entries: str) -> list[Part]:
    """``model.freeze`` / ``model.lora`` entries as the run's plan reads them."""
    layout = Layout.parse("language=dp1;image=dp1;audio=dp1")
    return [Part.parse(entry, layout, "model.freeze") for entry in entries]


def test_frozen_parts_count_the_passes_they_run():
    dims = SimpleNamespace(encoders={"image": None, "audio": None})
    assert training_passes(dims) == {"image.encoder": 3, "image.projection": 3,
                                     "audio.encoder": 3, "audio.projection": 3, "language": 3}
    found = training_passes(dims, parts("image", "audio.encoder", "language"))
    assert found == {"image.encoder": 1, "image.projection": 1, "audio.encoder": 1,
                     "audio.projection": 3, "language": 2}
    assert training_passes(dims, parts("image", "audio", "language"),
                           parts("language"))["language"] == 3
    assert training_passes(SimpleNamespace(encoders={}), parts("language")) == {"language": 1}
    # a frozen projection behind a trained tower: forward and its input's gradient
    assert training_passes(dims, parts("image.projection"))["image.projection"] == 2


def test_one_trains_for_flops_and_memory():
    """``trains``: the passes' view (a LoRA part computes weight gradients) and, with the LoRA
    parts counted as fixed, the memory view (its own weights keep no gradients or state)."""
    assert trains("image.encoder") and not trains("image.encoder", parts("image"))
    assert not trains("image.projection", parts("image.projection"))
    assert trains("image.encoder", parts("image.projection"))
    assert trains("language", parts("language"), parts("language"))   # LoRA over a freeze
    assert trains("image.encoder", parts("image"), parts("image"))
    assert not trains("language", parts("language", "language"))      # its base weights
    assert not trains("image.encoder", parts("image.encoder"))


def test_peaks_by_gpu_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA H200", "fp32") == 67.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops("Some GPU", "bf16") is None and peak_tflops(None, "bf16") is None


def test_published_qwen2_5_vl_7b_dims(tmp_path):
    """From the published config.json alone (no weights): its dims and its ~8.3B weights."""
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.planning.dims import from_plan
    preprocess = tmp_path / "preprocess.yaml"
    preprocess.write_text(f"tokenizer: {PUBLISHED}\nseq_length: 4096\npositions: mrope\n"
                          "modalities:\n  image: {policy: dynamic}\n")
    cfg = TrainConfig.load(None, ["data.datasets=[x]", f"data.preprocess={preprocess}",
                                  f"model.pretrained={PUBLISHED}",
                                  "layout=image=dp1;language=dp1"])
    dims = from_plan(resolve(cfg), tokenizer_size=151665)
    assert dims.language == Stack(28, 3584, 28, 4, 128, 18944, gated=True, vocab=152064)
    image = dims.encoders["image"]
    # what transformers' tower keeps (memory.py): under SDPA q, k, v (the values a copy,
    # not a view of the QKV output), SDPA's output and its copy (its RMSNorms and gated SiLU
    # fused by mimo keep what megatron-core's do)
    assert image.tower.stack == Stack(32, 1280, 16, 16, 80, 3420, gated=True,
                                      attention_kept=10)
    assert (image.tower.window, image.tower.full_attention_layers, image.tower.output_size,
            image.projection) == (4, (7, 15, 23, 31), 3584, ())
    total = dims.language.parameters() + image.parameters()
    assert total == pytest.approx(8.29e9, rel=0.01)


def test_config_dims_are_the_built_encoders(tmp_path):
    """``from_plan`` (nothing built: the trainer's FLOPs dims) gives the towers and
    projections the build makes."""
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.config import TrainConfig
    from mimo_train.families.base import Projection
    from mimo_train.families.registry import build_encoder
    from mimo_train.plan import resolve
    from mimo_train.planning.dims import from_plan
    preprocess = tmp_path / "preprocess.yaml"
    preprocess.write_text(f"tokenizer: {PUBLISHED}\nseq_length: 256\nmodalities:\n"
                          "  image: {policy: fixed, image_size: 56, patch_size: 14}\n"
                          "  audio: {max_duration: 4.0}\n")
    cfg = TrainConfig.load(None, [
        "data.datasets=[x]", f"data.preprocess={preprocess}", "layout=image=dp1;audio=dp1;"
        "language=dp1", "model.encoders.audio.hidden_size=16", "model.projection=mlp",
        "model.language.vocab_size=256", "model.language.hidden_size=64"])
    config = PreprocessConfig.from_yaml(str(preprocess))
    expected = from_plan(resolve(cfg, config))
    assert expected.language == Stack(2, 64, 4, 4, 16, 256, gated=False, vocab=256)
    for name, modality, kind in (("image", "image", "siglip"), ("audio", "audio", "whisper")):
        spec = cfg.model.encoders.get(name)
        hidden = spec.hidden_size if spec else 32
        encoder = build_encoder(kind, config.modalities[modality], hidden, 1, 2, None)
        projection = Projection(encoder.output_size, 64, "mlp")
        module = expected.encoders[name]
        assert module.modalities == (modality,)
        assert module.tower == tower_from_hf(kind, encoder.model.config, encoder.output_size)
        assert module.projection == tuple(Linear(layer.in_features, layer.out_features)
                                          for layer in projection
                                          if hasattr(layer, "in_features"))
    assert expected.encoders["audio"].tower.fixed_grid == (1, 200)
    assert expected.encoders["image"].tower.fixed_grid == (4, 4)


def _qwen2_vl_config():
    from mimo_train.families.qwen2_vl import Qwen2VLVision
    return Qwen2VLVision.random_config(ImageConfig(), 32, 1, 2)


def test_record_rate_mfu_and_step_line():
    from mimo_train.components.metrics import flops_fields, line, train_record
    # 8e14 FLOPs in 2 s on 4 ranks: 100 TFLOP/s per GPU, of a 989 peak
    fields = flops_fields({"language": 6e14, "image": 2e14}, 2.0, 4, 989.0)
    assert fields["tflops_per_gpu"] == pytest.approx(100.0)
    assert fields["mfu"] == pytest.approx(100 / 989)
    record = {**train_record(1, 2.0, 1.0, 0.5, {"language": 1e-3}, False, 2.0, 8,
                             {"language": 0.1}), **fields}
    assert "  100 TFLOP/s  MFU 10.1%  forward:" in line(record)
    record.update(flops_fields({"language": 1e12}, 1.0, 1, None))
    assert record["mfu"] is None and "  1 TFLOP/s  forward:" in line(record)


def test_a_records_lr_is_the_language_modules():
    """A step record's ``lr`` (TensorBoard's and W&B's ``train/lr``) is the language module's
    learning rate, not the first module's (an image tower frozen at 0, say); a rank without the
    language module gives its first module's, and the step line names each module's rate where
    they differ."""
    from mimo_train.components.metrics import line, train_record
    record = train_record(1, 2.0, 1.0, 0.5, {"image": 0.0, "language": 1e-3}, False, 2.0, 8,
                          {"image": 0.1, "language": 0.1})
    assert record["lr"] == 1e-3 and record["lrs"] == {"image": 0.0, "language": 1e-3}
    assert "  lr image 0.00e+00 language 1.00e-03  " in line(record)
    assert train_record(1, 2.0, 1.0, 0.5, {"audio": 3e-4, "image": 2e-4}, False, 2.0, 8,
                        {"audio": 0.1})["lr"] == 3e-4
    assert train_record(1, 2.0, 1.0, 0.5, {}, False, 2.0, 8, {})["lr"] == 0.0


# ------------------------------------------------------------------------------ Qwen3.5

# the dense replica's language model (QWEN3_5's text_config): h 64, 4 heads of 64 in 2 query
# groups, the gated attention's q_proj twice as wide; SwiGLU MLP 96; delta-net layers of 2 key
# heads and 4 value heads of 16 (key_dim 32, value_dim 64), a convolution of 4; 248320 rows,
# tied to the embedding
HYBRID = Stack(4, 64, 4, 2, 64, 96, gated=True, vocab=248320, tied=True,
               layer_types=(LINEAR, LINEAR, LINEAR, FULL),
               linear=LinearAttention(conv_kernel=4, key_head_dim=16, value_head_dim=16,
                                      num_key_heads=2, num_value_heads=4),
               attention_gate=True)


def test_gated_delta_net_layer_hand_count():
    # per token: in_proj_qkv 2·64·(2·32 + 64) = 16384, in_proj_z 2·64·64 = 8192, in_proj_b and
    # in_proj_a 2·64·4 each = 1024, out_proj 2·64·64 = 8192: 33792; MLP 2·64·96·3 = 36864;
    # convolution 2·4·(2·32 + 64) = 1024; state reads and update 4 heads · 6·16·16 = 6144
    assert layer_flops_per_token(HYBRID, LINEAR) == 33792 + 36864 + 1024 + 6144 == 77824
    # per chunk and value head: k_β·kᵀ 2·C²·16, q·kᵀ 2·C²·16, the solves C²·16 + C²·16,
    # (q·kᵀ)·v_new 2·C²·16: C²·(5·16 + 3·16) = 128·C², 4 heads: 512 per unit of chunk square
    assert layer_square_flops(HYBRID, LINEAR) == 512
    # a sample of 100 tokens: a chunk of 64 and one of 36 (its own tokens, not the padded 64)
    assert chunk_square(100) == 64 * 64 + 36 * 36 == 5392
    assert chunk_square(128) == 2 * 4096 and chunk_square(5) == 25 and chunk_square(0) == 0


def test_gated_attention_layer_hand_count():
    # q_proj 2·64·(2·256) = 65536 (each head's query and its gate), k_proj and v_proj
    # 2·64·128 each = 32768, o_proj 2·256·64 = 32768: 131072; MLP 36864; attention 4·256 per s²
    assert layer_flops_per_token(HYBRID, FULL) == 131072 + 36864 == 167936
    assert layer_square_flops(HYBRID, FULL) == 1024
    # without the gate q_proj is 2·64·256 = 32768 narrower
    plain = Stack(4, 64, 4, 2, 64, 96, gated=True)
    assert layer_flops_per_token(plain) == 167936 - 32768


def test_hybrid_language_model_hand_count():
    # one sample of 100 tokens, forward: per token 3 · 77824 + 167936 + logits 2·64·248320
    # (31784960) = 32186368, × 100 = 3218636800; the delta rule's chunks 3 · 512 · 5392 =
    # 8282112; attention 1024 · 100² = 10240000. Training (x3): 3 · 3237158912
    assert language_flops(HYBRID, [100]) == 3 * (3_218_636_800 + 8_282_112 + 10_240_000)
    # two samples of 64 and 36 tokens: the same tokens, each sample its own chunk and square
    assert language_flops(HYBRID, [64, 36], passes=1) == \
        3_218_636_800 + 3 * 512 * (4096 + 1296) + 1024 * (64 ** 2 + 36 ** 2)


def test_shared_expert_hand_count():
    # the MoE replica's MLP: 4 experts of 24, 2 a token, a shared expert of 32 and its gate:
    # router 2·64·4 = 512, experts 2 · (2·64·48 + 2·24·64) = 18432, shared 2·64·64 + 2·32·64 =
    # 12288, its gate 2·64 = 128: 31360 per token
    moe = Stack(4, 64, 4, 2, 64, 24, gated=True, experts=4, experts_per_token=2,
                shared_expert_ffn=32)
    assert layer_flops_per_token(moe) - layer_flops_per_token(
        Stack(4, 64, 4, 2, 64, 0, gated=True)) == 31360


def test_qwen3_5_dims_from_the_checkpoint_config():
    """The replicas' language models as the plan reads them (config.json alone)."""
    from mimo_train.config import LanguageConfig
    from mimo_train.plan.language import language_plan
    from mimo_train.planning.dims import language_stack
    assert language_stack(language_plan(LanguageConfig(), str(QWEN3_5))) == HYBRID
    moe = language_stack(language_plan(LanguageConfig(), str(QWEN3_5_MOE)))
    assert moe == Stack(4, 64, 4, 2, 64, 24, gated=True, vocab=248320, experts=8,
                        experts_per_token=2, shared_expert_ffn=32,
                        layer_types=HYBRID.layer_types, linear=HYBRID.linear,
                        attention_gate=True)


def test_step_records_count_the_hybrid_layers():
    """The trainer's ``FlopsCounter`` (its step records' ``flops``) counts a hybrid stack
    through ``step_flops``, unchanged: the hand count above."""
    import torch

    from mimo_train.components.metrics import FlopsCounter
    from mimo_train.planning.dims import ModelDims
    counter = FlopsCounter(ModelDims(HYBRID), ["language"], {"language": 3}, True, None)
    counter.add({"tokens": [100], "trained_tokens": [100]})
    assert counter.take(torch.device("cpu")).tolist() == \
        [3 * (3_218_636_800 + 8_282_112 + 10_240_000)]


def _counted(module, *args, **kwargs) -> dict[str, int]:
    """FLOPs torch's counter counts in ``module``'s forward, by aten op."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        module(*args, **kwargs)
    return {str(op).split(".")[1]: n for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.fixture(scope="module")
def qwen3_5_text():
    """The replicas' transformers text configs (eager attention: its products are counted)."""
    from transformers import AutoConfig
    found = []
    for path in (QWEN3_5, QWEN3_5_MOE):
        config = AutoConfig.from_pretrained(path).get_text_config()
        config._attn_implementation = "eager"
        found.append(config)
    return found


def test_delta_net_flops_are_what_torch_counts_in_transformers_layer(qwen3_5_text):
    """transformers' ``Qwen3_5GatedDeltaNet`` on 128 tokens (two whole chunks: its padding
    adds nothing): its matmuls (aten.mm) are the projections, its batched products (aten.bmm)
    the chunked rule but its triangular solves (which the counter does not count: C²·(d_k +
    d_v) per chunk and value head, added here), its convolution (aten.convolution) ours over
    the s + K - 1 outputs transformers' fallback computes (padded both sides, K - 1 dropped)."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(qwen3_5_text[0], layer_idx=0)
    s, linear = 128, HYBRID.linear
    counted = _counted(layer, torch.randn(1, s, 64))
    mlp = 2 * 64 * 96 * 3
    projections = sum(2 * lin.inputs * lin.outputs for lin in HYBRID.layer_linears(LINEAR))
    assert counted["mm"] == s * (projections - mlp)
    solves = 2 * linear.num_value_heads * 64 * 64 * (16 + 16)       # 2 chunks
    state = 6 * 16 * 16 * linear.num_value_heads
    assert counted["bmm"] + solves == s * state + layer_square_flops(HYBRID, LINEAR) * \
        chunk_square(s)
    conv = 2 * 4 * (2 * 32 + 64)
    assert counted["convolution"] == conv * (s + 4 - 1)
    assert layer_flops_per_token(HYBRID, LINEAR) == projections + conv + state


def test_gated_attention_flops_are_what_torch_counts(qwen3_5_text):
    """transformers' ``Qwen3_5Attention`` (eager: the score and value products are matmuls)
    on 100 tokens: the projections (the gate's rows too) and the whole s² square."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention
    layer = Qwen3_5Attention(qwen3_5_text[0], layer_idx=3)
    s, rotary = 100, 16                       # a quarter of each 64-wide head rotates
    counted = _counted(layer, torch.randn(1, s, 64),
                       (torch.ones(1, s, rotary), torch.zeros(1, s, rotary)), None)
    mlp = 2 * 64 * 96 * 3
    assert counted["mm"] == s * (layer_flops_per_token(HYBRID, FULL) - mlp)
    assert counted["bmm"] == layer_square_flops(HYBRID, FULL) * s * s


def test_shared_expert_flops_are_what_torch_counts(qwen3_5_text):
    """transformers' ``Qwen3_5MoeSparseMoeBlock``: router, two experts a token, the shared
    expert and its gate."""
    import torch
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
    torch.manual_seed(0)
    block = Qwen3_5MoeSparseMoeBlock(qwen3_5_text[1])
    counted = _counted(block, torch.randn(1, 100, 64))
    moe = Stack(4, 64, 4, 2, 64, 24, gated=True, experts=8, experts_per_token=2,
                shared_expert_ffn=32)
    attention = Stack(4, 64, 4, 2, 64, 0, gated=True)
    assert counted == {"mm": 100 * (layer_flops_per_token(moe)
                                    - layer_flops_per_token(attention))}


def test_qwen3_vl_30b_a3b_counts_the_routed_experts_a_token_takes():
    """The published Qwen3-VL-30B-A3B's language layer as the plan reads its config.json: the
    attention (32 query heads and 4 KV groups of 128), the router over 128 experts and the
    8 experts of 768 a token goes through, not all 128 (which would be 16x the experts')."""
    from mimo_train.config import LanguageConfig
    from mimo_train.plan.language import language_plan
    from mimo_train.planning.dims import language_stack
    from mimo_train.planning.flops import expert_flops_per_token
    published = REPO / "tools" / "published" / "Qwen--Qwen3-VL-30B-A3B-Instruct"
    stack = language_stack(language_plan(LanguageConfig(), str(published)))
    assert (stack.experts, stack.experts_per_token) == (128, 8)
    experts = 2 * 8 * (2048 * 2 * 768 + 768 * 2048)
    attention = 2 * (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048)
    assert expert_flops_per_token(stack) == experts == 75_497_472
    assert layer_flops_per_token(stack) == attention + 2 * 2048 * 128 + experts
