"""Logits of language models imported from transformers checkpoints, against transformers',
for tests/test_hf_language.py.

    torchrun --nproc-per-node N tests/jobs/hf_language_parity.py OUT LAYOUTS [--mrope DIR] DIR...

(the tests run it on forked ranks: ``ranks.run``, tests/support/launch.py)

For each layout in ``LAYOUTS`` (``;``-free layouts joined by ``+``, e.g.
``language=dp2+language=tp2+language=pp2``) and each model directory: builds the language
model as training does (``TrainConfig`` with ``model.language.pretrained``, the layout's
process groups, ``language_model_params``, ``load_language_weights``), runs real text through
it (pipeline stages hand the hidden states on with send/recv), gathers the last stage's logits
over TP and compares them with transformers' on the same tokens. ``--mrope DIR``: the Qwen2
checkpoint ``DIR`` also with ``model.language.mrope_section`` and M-RoPE position ids (a grid of
tokens amid the text), against transformers' Qwen2-VL text model holding the same weights,
under the local and sdpa attention, padded rows and the rows packed into one. Rank 0 writes
``OUT/result.json``: ``{layout: {model: max |difference| or the error message}}``, the M-RoPE
cases as ``mrope/BACKEND/padded|packed``. Each transformers reference is computed once, on a rank
that has logits, and reused by every layout.
"""

import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist

from mimo_data.loading.layout import LANGUAGE, Layout
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.positions import mrope_positions
from mimo_train.config import TrainConfig
from mimo_train.plan import resolve
from mimo_train.errors import TrainConfigError
from mimo_train.mcore.grids import build_infra
from mimo_train.mcore import model_parallel_cuda_manual_seed, parallel_state
from mimo_train.model.build import (_SeededGPTModel, language_model_params,
                              language_transformer_config, load_language_weights)

TEXTS = ["The Eiffel Tower is in Paris, the capital of France, and it was built in 1889.",
         "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen."]
TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "assets", "tokenizer", "smollm2")


def tokens() -> torch.Tensor:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    length = min(map(len, ids))
    return torch.tensor([row[:length] for row in ids])


def reference(path: str, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids).logits


def megatron_logits(path: str, layout: str, input_ids: torch.Tensor,
                    position_ids: torch.Tensor | None = None, overrides: tuple = (),
                    backend: str = "local", packed: bool = False) -> torch.Tensor | None:
    """The model's logits [b, s, vocab] on the last stage (TP-gathered), None elsewhere;
    ``packed``: the rows run as one packed row (THD, one sample per row)."""
    text = PreprocessConfig(tokenizer=path, seq_length=input_ids.size(1), modalities={},
                            positions="mrope" if overrides else "sequential")
    plan = resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"layout={layout}",
                                           f"model.language.pretrained={path}", *overrides]),
                   text)
    infra = build_infra(Layout.parse(layout), "gloo")
    part = infra.role.module(LANGUAGE)
    model_parallel_cuda_manual_seed(1, tp_rank=part.tp_rank, ep_rank=0, etp_rank=0)
    transformer = language_transformer_config(plan)
    vocab = -(-max(len_vocab(path), 1) // 128) * 128
    model = _SeededGPTModel(vocabulary=vocab, **language_model_params(
        plan, infra, transformer, vocab, backend))
    load_language_weights(model, plan.language, infra, vocab)
    model.eval()
    pgs = infra.modules[LANGUAGE].pgs
    if position_ids is None:
        position_ids = torch.arange(input_ids.size(1)).expand_as(input_ids)
    rows, length = input_ids.shape
    packing = None
    if packed:
        from megatron.core.packed_seq_params import PackedSeqParams
        bounds = torch.arange(0, rows * length + 1, length, dtype=torch.int32)
        packing = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                  max_seqlen_q=length, max_seqlen_kv=length)
        input_ids = input_ids.reshape(1, -1)
        position_ids = position_ids.reshape(*position_ids.shape[:-2], 1, -1)
    pp_ranks = dist.get_process_group_ranks(pgs.pp)
    with torch.no_grad():
        if not part.first_stage:
            hidden = torch.empty(input_ids.size(1), input_ids.size(0),
                                 plan.language.hidden_size)
            dist.recv(hidden, src=pp_ranks[part.pp_rank - 1])
            model.set_input_tensor(hidden)
        out = model(input_ids if part.first_stage else None, position_ids, None,
                    packed_seq_params=packing)
        if not part.last_stage:
            dist.send(out.contiguous(), dst=pp_ranks[part.pp_rank + 1])
            return None
    shards = [torch.empty_like(out) for _ in range(part.module.tp)]
    dist.all_gather(shards, out.contiguous(), group=pgs.tp)
    return torch.cat(shards, dim=-1).reshape(rows, length, -1)


MROPE_SECTION = [2, 3, 3]          # rotary pairs of tiny-qwen2's head_dim 16


def mrope_positions_of(input_ids: torch.Tensor) -> torch.Tensor:
    """[3, b, s] M-RoPE ids: a 2 x 3 grid of tokens after the first three, the rest text."""
    grid = np.zeros(input_ids.size(1), bool)
    grid[3:9] = True
    return torch.stack([torch.from_numpy(mrope_positions(np.where(grid, -1, row.numpy()),
                                                         [(-1, 6, (1, 2, 3), 1.0)]))
                        for row in input_ids], dim=1)


def mrope_reference(path: str, input_ids: torch.Tensor, position_ids: torch.Tensor
                    ) -> torch.Tensor:
    """transformers' Qwen2-VL text model with the Qwen2 checkpoint's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel
    qwen2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    fields = AutoConfig.from_pretrained(path).to_dict()
    fields["rope_parameters"] = {**fields["rope_parameters"], "mrope_section": MROPE_SECTION}
    text = Qwen2VLTextModel(Qwen2VLTextConfig(**{k: v for k, v in fields.items()
                                                 if k != "model_type"}))
    missing, unexpected = text.load_state_dict(qwen2.model.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    with torch.no_grad():
        hidden = text(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        return qwen2.lm_head(hidden)


def len_vocab(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


_REFERENCES: dict = {}


def compare(logits: torch.Tensor | None, expected, *args) -> float:
    """Max |logits - expected(*args)| over the ranks (only the last stage has logits);
    ``expected(*args)`` is computed once per process (args: a path, then tensors)."""
    difference = torch.tensor(-1.0)
    if logits is not None:
        key = (expected.__name__, args[0])
        if key not in _REFERENCES:
            _REFERENCES[key] = expected(*args)
        reference_logits = _REFERENCES[key]
        difference = (logits[..., :reference_logits.size(-1)] - reference_logits).abs().max()
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    return difference.item()


def main(out: str, layouts: str, paths: list[str], mrope: str | None) -> None:
    dist.init_process_group("gloo")
    parallel_state._set_global_memory_buffer()
    torch.set_num_threads(1)
    input_ids = tokens()
    results: dict = {}
    for layout in layouts.split("+"):
        for path in paths:
            name = os.path.basename(path.rstrip("/"))
            try:
                logits = megatron_logits(path, layout, input_ids)
            except TrainConfigError as error:
                results.setdefault(layout, {})[name] = str(error)
                continue
            results.setdefault(layout, {})[name] = compare(
                logits, reference, path, input_ids)
        if mrope is None:
            continue
        position_ids = mrope_positions_of(input_ids)
        for backend in ("local", "sdpa"):
            for packed in (False, True):
                logits = megatron_logits(mrope, layout, input_ids, position_ids,
                                         (f"model.language.mrope_section={MROPE_SECTION}",),
                                         backend, packed)
                case = f"mrope/{backend}/{'packed' if packed else 'padded'}"
                results.setdefault(layout, {})[case] = compare(
                    logits, mrope_reference, mrope, input_ids, position_ids)
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    arguments = argparse.ArgumentParser()
    arguments.add_argument("out")
    arguments.add_argument("layouts")
    arguments.add_argument("--mrope")
    arguments.add_argument("paths", nargs="*")
    args = arguments.parse_intermixed_args()
    main(args.out, args.layouts, args.paths, args.mrope)
