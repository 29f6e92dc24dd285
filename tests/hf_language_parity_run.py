"""Logits of language models imported from transformers checkpoints, against transformers',
for tests/test_hf_language.py.

    torchrun --nproc-per-node N tests/hf_language_parity_run.py OUT LAYOUTS MODEL_DIR...

For each layout in ``LAYOUTS`` (``;``-free layouts joined by ``+``, e.g.
``language=dp2+language=tp2+language=pp2``) and each model directory: builds the language
model as training does (``TrainConfig`` with ``model.language.pretrained``, the layout's
process groups, ``language_model_params``, ``load_language_weights``), runs real text through
it (pipeline stages hand the hidden states on with send/recv), gathers the last stage's logits
over TP and compares them with transformers' on the same tokens. Rank 0 writes
``OUT/result.json``: ``{layout: {model: max |difference| or the error message}}``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from mimo_data.loading.layout import LANGUAGE, Layout
from mimo_train.config import TrainConfig, TrainConfigError
from mimo_train.infra import build_infra
from mimo_train.mcore import model_parallel_cuda_manual_seed, parallel_state
from mimo_train.model import (_SeededGPTModel, language_model_params,
                              language_transformer_config, load_language_weights)

TEXTS = ["The Eiffel Tower is in Paris, the capital of France, and it was built in 1889.",
         "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen."]
TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "assets", "tokenizer", "smollm2")


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


def megatron_logits(path: str, layout: str, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The model's logits [b, s, vocab] on the last stage (TP-gathered), None elsewhere."""
    cfg = TrainConfig.load(None, ["data.datasets=[unused]", f"layout={layout}",
                                  f"model.language.pretrained={path}"])
    infra = build_infra(Layout.parse(layout), "gloo")
    part = infra.role.module(LANGUAGE)
    model_parallel_cuda_manual_seed(1, tp_rank=part.tp_rank, ep_rank=0, etp_rank=0)
    transformer = language_transformer_config(cfg, infra.layout, torch.device("cpu"))
    vocab = -(-max(len_vocab(path), 1) // 128) * 128
    model = _SeededGPTModel(**language_model_params(cfg, infra, transformer, vocab,
                                                    input_ids.size(1), "local"))
    load_language_weights(model, cfg, infra, vocab)
    model.eval()
    pgs = infra.modules[LANGUAGE].pgs
    position_ids = torch.arange(input_ids.size(1)).expand_as(input_ids)
    pp_ranks = dist.get_process_group_ranks(pgs.pp)
    with torch.no_grad():
        if not part.first_stage:
            hidden = torch.empty(input_ids.size(1), input_ids.size(0), cfg.model.language
                                 .hidden_size)
            dist.recv(hidden, src=pp_ranks[part.pp_rank - 1])
            model.set_input_tensor(hidden)
        out = model(input_ids if part.first_stage else None, position_ids, None)
        if not part.last_stage:
            dist.send(out.contiguous(), dst=pp_ranks[part.pp_rank + 1])
            return None
    shards = [torch.empty_like(out) for _ in range(part.module.tp)]
    dist.all_gather(shards, out.contiguous(), group=pgs.tp)
    return torch.cat(shards, dim=-1)


def len_vocab(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


def main(out: str, layouts: str, paths: list[str]) -> None:
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
            difference = torch.tensor(-1.0)
            if logits is not None:
                expected = reference(path, input_ids)
                difference = (logits[..., :expected.size(-1)] - expected).abs().max()
            dist.all_reduce(difference, op=dist.ReduceOp.MAX)
            results.setdefault(layout, {})[name] = difference.item()
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
