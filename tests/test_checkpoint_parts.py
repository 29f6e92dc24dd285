"""Importing a checkpoint reads only what a rank holds (``CheckpointWeights.part``,
mimo_train/families/causal_lm/parts.py), on the published-shaped mixture-of-experts replicas
(Qwen3-VL-30B-A3B: experts stored transposed, as published; Qwen3.5-35B-A3B: experts in
transformers 5's layout, gated delta-net layers, a shared expert, fp32 ``A_log``) and the dense
Qwen2.5-VL-3B (qkv biases), at TP 1, 2 and 4, in process:

- each TP rank's megatron state read in parts equals the one cut from whole fp32 reads (every
  tensor), and the TP ranks' parts merged back (``to_hf``) give the checkpoint;
- every part is read through safetensors' ``get_slice`` in the dtype the file stores (bf16
  stays bf16), never with ``get_tensor``;
- a rank reads 1/TP of the bytes of each tensor TP splits, and all of those only megatron-core
  keeps whole on every rank (norms, the routers);
- an expert range reads and gives only those experts.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from conftest import MODELS

PUBLISHED = MODELS / "published"
MIXTURES = ["Qwen--Qwen3-VL-30B-A3B-Instruct", "Qwen--Qwen3.5-35B-A3B"]
CHECKPOINTS = [*MIXTURES, "Qwen--Qwen2.5-VL-3B-Instruct"]
# what megatron-core keeps whole on every TP rank: norms, the routers, the shared expert's gate
WHOLE = ("norm.weight", "mlp.gate.weight", "shared_expert_gate.weight")
QKV = tuple(f"{proj}_proj.{kind}" for proj in "qkv" for kind in ("weight", "bias"))
DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}


class _CountedSlice:
    def __init__(self, handle, name: str, reads: list):
        self.slice, self.name, self.reads = handle.get_slice(name), name, reads

    def get_shape(self):
        return self.slice.get_shape()

    def __getitem__(self, index):
        part = self.slice[index]
        self.reads.append((self.name, part.numel() * part.element_size(), part.dtype,
                           DTYPES[self.slice.get_dtype()]))
        return part


class _Counted:
    """A safetensors file handle recording each slice read: name, bytes, dtype read, dtype
    stored."""

    def __init__(self, handle, reads: list):
        self.handle, self.reads = handle, reads

    def get_slice(self, name: str) -> _CountedSlice:
        return _CountedSlice(self.handle, name, self.reads)

    def get_tensor(self, name: str):
        raise AssertionError(f"{name} read whole")


def _counted(path) -> tuple:
    from mimo_train.families.base import CheckpointWeights
    weights, reads = CheckpointWeights(str(path)), []
    weights.files = {name: _Counted(handle, reads) for name, handle in weights.files.items()}
    return weights, reads


def _import(weights, arch, tp_rank: int, tp_size: int, **options) -> dict:
    """The rank's state from ``weights``: ``CheckpointWeights`` or a dict of whole tensors."""
    from mimo_train.families.causal_lm import to_megatron
    read = weights.__getitem__ if isinstance(weights, dict) else weights
    return to_megatron(read, arch, tp_rank=tp_rank, tp_size=tp_size,
                       layers=range(arch.num_layers), first_stage=True, last_stage=True,
                       vocab_size=arch.vocab_size, has=weights.__contains__, **options)


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request) -> dict:
    """The checkpoint, its architecture, its language model's tensors' stored bytes (from the
    files' headers) and the fp32 whole tensors each rank's state is cut from."""
    from mimo_train.families.base import CheckpointWeights
    from mimo_train.families.registry import language_arch
    path = PUBLISHED / request.param
    arch = language_arch(str(path))
    weights = CheckpointWeights(str(path))
    stored = {}
    for name, handle in weights.files.items():
        if name.startswith(tuple(arch.prefix + part for part in ("layers.", "norm.",
                                                                  "embed_tokens."))) \
                or name == arch.head:
            header = handle.get_slice(name)
            stored[name] = math.prod(header.get_shape()) * DTYPES[header.get_dtype()].itemsize
    whole = {name: weights(name) for name in stored}
    return dict(path=path, arch=arch, stored=stored, whole=whole)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_rank_reads_its_parts_in_the_stored_dtype(checkpoint, tp):
    from mimo_train.families.causal_lm import to_hf
    arch, whole = checkpoint["arch"], checkpoint["whole"]
    parts = []
    for rank in range(tp):
        weights, reads = _counted(checkpoint["path"])
        state = _import(weights, arch, rank, tp)
        cut = _import(whole, arch, rank, tp)
        assert set(state) == set(cut)
        for key, value in cut.items():
            assert value.dtype == torch.float32
            assert torch.equal(state[key].float(), value), (tp, rank, key)
        assert {(read, stored) for _, _, read, stored in reads} <= {
            (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)}
        assert any(stored == torch.bfloat16 for *_, stored in reads)
        expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
        if arch.experts:
            assert state[expert].dtype == torch.bfloat16
        read: dict[str, int] = defaultdict(int)
        for name, size, *_ in reads:
            read[name] += size
        # q/k/v of a TP size splitting a query group (megatron-core refuses it) are read whole
        split_groups = arch.num_query_groups % tp != 0
        for name, size in checkpoint["stored"].items():
            # a tied embedding is read twice: the embedding's rows, the output layer's
            times = 2 if arch.tied and name == arch.prefix + "embed_tokens.weight" else 1
            if name.endswith(WHOLE) or (split_groups and name.endswith(QKV)):
                assert read[name] == size, (tp, rank, name)
            else:
                assert read[name] == times * size // tp, (tp, rank, name, read[name], size)
        parts.append(state)
    back = to_hf(parts, arch)
    for name, value in back.items():
        expected = whole[name]
        if value.shape != expected.shape:              # experts published transposed
            expected = expected.transpose(1, 2)
        assert torch.equal(value.float(), expected), (tp, name)


@pytest.mark.parametrize("checkpoint", MIXTURES, indirect=True)
def test_an_expert_range_reads_and_gives_only_those_experts(checkpoint):
    arch, whole = checkpoint["arch"], checkpoint["whole"]
    weights, reads = _counted(checkpoint["path"])
    state = _import(weights, arch, 1, 2, experts=range(1, 3))
    every = _import(whole, arch, 1, 2)
    experts = "decoder.layers.{}.mlp.experts.local_experts.{}."
    for layer in range(arch.num_layers):
        held = {k for k in state
                if k.startswith(f"decoder.layers.{layer}.mlp.experts.local_experts.")}
        assert held == {experts.format(layer, e) + f"linear_fc{i}.weight"
                        for e in (0, 1) for i in (1, 2)}
        for local, expert in ((0, 1), (1, 2)):
            for fc in ("linear_fc1.weight", "linear_fc2.weight"):
                assert torch.equal(state[experts.format(layer, local) + fc].float(),
                                   every[experts.format(layer, expert) + fc])
    fused = [(name, size) for name, size, *_ in reads if name.endswith("_proj") and
             ".experts." in name]
    stored = checkpoint["stored"]
    for name in {name for name, _ in fused}:
        # 2 of the experts, half of each (TP 2)
        assert sum(size for n, size in fused if n == name) == stored[name] * 2 // arch.experts // 2


def test_a_folder_with_a_single_file_and_an_index_is_read_as_transformers_reads_it(tmp_path):
    """A sharded save into a folder that held a single-file save leaves ``model.safetensors``
    beside the index and its shards: transformers loads the single file, and so does mimo
    (not the shards' other weights without a word)."""
    from transformers import Qwen2VLForConditionalGeneration

    from mimo_train.families.base import CheckpointWeights
    model = Qwen2VLForConditionalGeneration.from_pretrained(MODELS / "tiny-qwen2-vl",
                                                            dtype=torch.float32)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors").exists() and \
        (tmp_path / "model.safetensors.index.json").exists()
    loaded = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    state, weights = loaded.state_dict(), CheckpointWeights(str(tmp_path))
    # the names as transformers saves them (its older ones) and as its model holds them
    for stored, held in (
            ("lm_head.weight", "lm_head.weight"),
            ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
            ("visual.patch_embed.proj.weight", "model.visual.patch_embed.proj.weight")):
        assert torch.equal(weights(stored), state[held]), stored


def test_weight_files_that_cannot_be_read_are_named_with_what_to_do(tmp_path):
    """A git-lfs pointer where the weights should be (a clone without git-lfs), a shard cut
    short, a shard the index names but the folder lacks, the weights only as a pickle: one
    refusal naming the file and what to do, not safetensors' error from inside the build."""
    import json

    from safetensors.torch import save_file

    from mimo_train.errors import TrainConfigError
    from mimo_train.families.base import CheckpointWeights
    pointer = tmp_path / "pointer"
    pointer.mkdir()
    (pointer / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 19736752\n")
    with pytest.raises(TrainConfigError, match=r"model.pretrained .*pointer: model.safetensors "
                       r"is not a whole safetensors file \(.*\): a git-lfs pointer, or a "
                       "download cut short; download it again"):
        CheckpointWeights(str(pointer), "model.pretrained")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file({"a": torch.ones(64, 64)}, sharded / names[0])
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": names[0], "b": names[1]}}))
    with pytest.raises(TrainConfigError, match=f"{names[1]}, which its "
                       "model.safetensors.index.json names, is missing"):
        CheckpointWeights(str(sharded))
    whole = (sharded / names[0]).read_bytes()
    save_file({"b": torch.ones(64, 64)}, sharded / names[1])
    (sharded / names[0]).write_bytes(whole[:len(whole) // 2])
    with pytest.raises(TrainConfigError, match=f"{names[0]} is not a whole safetensors file"):
        CheckpointWeights(str(sharded))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save({"a": torch.ones(2)}, pickled / "pytorch_model.bin")
    with pytest.raises(TrainConfigError, match="holds no model.safetensors .*, only "
                       "pytorch_model.bin: save it as safetensors"):
        CheckpointWeights(str(pickled))
