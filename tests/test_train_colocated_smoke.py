"""Spike smoke test (issue 5): one process, colocated layout, gloo on CPU: a tiny megatron-core
MimoModel (GPT language model + a Qwen2-VL vision tower + a linear projection) takes one batch
from mimo_data's loader, runs megatron-core's no-pipelining schedule with per-token loss,
per-module DDP gradient finalization and MimoOptimizer for three steps.

Run as a script it prints the losses; pytest runs it in a fresh interpreter (cpu_compat patches
are process-wide). To be replaced by the real mimo_train builders and the parity tests.
"""

import math
import os
import socket
import subprocess
import sys
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 49216            # >= the SmolLM2 tokenizer's 49154, a multiple of 64
HIDDEN = 64


def main(shards: str) -> None:
    import torch
    import torch.distributed as dist

    from mimo_train import cpu_compat
    cpu_compat.activate()

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.mimo import (MimoModel, MimoModelConfig, VisionModalitySubmodules,
                                           get_mimo_optimizer)
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel)

    from mimo_data.image_inputs import normalize_pixels
    from mimo_data.loader import build_loader
    from mimo_data.preprocess import Preprocessor
    from mimo_data.preprocess_config import PreprocessConfig

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    def grid_and_groups():
        grid = HyperCommGrid([1, 1, 1, 1], ["tp", "cp", "dp", "pp"], backend="gloo")
        grid.register_view("expert", shape=[1, 1, 1, 1],
                           dim_names=["expt_tp", "ep", "expt_dp", "pp"], shared_dims=["pp"])
        base = (["tp"], ["cp"], ["pp"], ["dp"], ["dp", "cp"], ["tp", "cp"], ["tp", "pp"],
                ["tp", "dp", "cp"], ["tp", "cp", "dp", "pp"])
        expert = (["ep"], ["expt_tp"], ["expt_dp"], ["expt_tp", "ep"], ["expt_tp", "ep", "pp"])
        for dims in base:
            grid.create_pg(dims)
        for dims in expert:
            grid.create_pg(dims, view="expert")
        pgs = ProcessGroupCollection(
            tp=grid.get_pg("tp"), cp=grid.get_pg("cp"), pp=grid.get_pg("pp"),
            dp=grid.get_pg("dp"), dp_cp=grid.get_pg(["dp", "cp"]),
            intra_dp_cp=grid.get_pg(["dp", "cp"]), tp_cp=grid.get_pg(["tp", "cp"]),
            mp=grid.get_pg(["tp", "pp"]), tp_dp_cp=grid.get_pg(["tp", "dp", "cp"]),
            ep=grid.get_pg("ep", view="expert"), expt_tp=grid.get_pg("expt_tp", view="expert"),
            expt_dp=grid.get_pg("expt_dp", view="expert"),
            intra_expt_dp=grid.get_pg("expt_dp", view="expert"),
            tp_ep=grid.get_pg(["expt_tp", "ep"], view="expert"),
            tp_ep_pp=grid.get_pg(["expt_tp", "ep", "pp"], view="expert"),
            embd=dist.new_group([0]), pos_embd=dist.new_group([0]))
        return grid, pgs

    config = PreprocessConfig.from_yaml(os.path.join(ROOT, "configs", "preprocess.yaml"))
    image = config.modalities["image"]
    image_token = Preprocessor(config, with_media=False).text.modality_token_ids["image"]

    class QwenVision(torch.nn.Module):
        """uint8 Qwen2-VL patches -> one vector per merged 2x2 patch, image by image."""

        def __init__(self, out_hidden: int):
            super().__init__()
            self.model = Qwen2VisionTransformerPretrainedModel._from_config(Qwen2VLVisionConfig(
                depth=1, embed_dim=32, hidden_size=out_hidden, num_heads=2, mlp_ratio=2,
                patch_size=image.patch_size, spatial_merge_size=image.merge_size,
                temporal_patch_size=image.temporal_patch_size, in_channels=3))

        def forward(self, pixel_values, image_grid_thw):
            pixels = normalize_pixels(pixel_values, image)
            return self.model(hidden_states=pixels, grid_thw=image_grid_thw).pooler_output

    parallel_state._set_global_memory_buffer()     # initialize_model_parallel is not used
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, tp_rank=0, ep_rank=0, etp_rank=0)
    language_grid, language_pgs = grid_and_groups()
    images_grid, images_pgs = grid_and_groups()
    transformer = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
        calculate_per_token_loss=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall", attention_dropout=0.0, hidden_dropout=0.0)
    language = ModuleSpec(module=GPTModel, params=dict(
        config=transformer, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=config.seq_length, position_embedding_type="rope",
        pg_collection=language_pgs))
    images = ModuleSpec(module=VisionModalitySubmodules, params=dict(pg_collection=images_pgs),
                        submodules=dict(
        encoders={image.encoder: ModuleSpec(module=QwenVision, params=dict(out_hidden=32))},
        input_projections=[ModuleSpec(module=torch.nn.Linear,
                                      params=dict(in_features=32, out_features=HIDDEN))]))
    model = MimoModel(MimoModelConfig(
        language_model_spec=language, modality_submodules_spec={"images": images},
        special_token_ids={"images": image_token},
        module_to_grid_map={"language": language_grid, "images": images_grid}))
    model.model_type = ModelType.encoder_or_decoder
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    model.language_model = DistributedDataParallel(transformer, ddp, model.language_model,
                                                   pg_collection=language_pgs)
    model.modality_submodules["images"] = DistributedDataParallel(
        transformer, ddp, model.modality_submodules["images"], pg_collection=images_pgs)
    optimizer = get_mimo_optimizer(model, OptimizerConfig(
        optimizer="adam", lr=1e-3, params_dtype=torch.float32, clip_grad=1.0))

    def finalize(model_list, num_tokens, force_all_reduce=False, **_):
        # one process: num_tokens is already the global count
        for module, pgs in ((model.language_model, language_pgs),
                            (model.modality_submodules["images"], images_pgs)):
            finalize_model_grads([module], num_tokens=None, pg_collection=pgs)
            module.scale_gradients(1.0 / num_tokens.item())

    transformer.finalize_model_grads_func = finalize
    transformer.grad_scale_func = lambda loss: loss

    loader = build_loader([shards], config, "language=dp1;images=dp1,off0;audio=dp1,off0", 0, 1,
                          global_batch_size=4, micro_batch_size=4, seed=1)
    batch, _ = next(iter(loader))
    loader.close()
    # the loader keys modality_inputs by modality, MimoModel by module (layout) name
    batch["modality_inputs"] = {"images": batch["modality_inputs"]["image"]}
    batch["attention_mask"] = None       # colocated MimoModel ignores it; causal mask only

    def loss_func(loss_mask, output):
        total = (output.float() * loss_mask).sum()
        tokens = loss_mask.sum().to(torch.int)
        return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.float()])}

    def forward_step(data_iterator, model):
        output, loss_mask = model(**next(data_iterator))
        return output, partial(loss_func, loss_mask)

    schedule = get_forward_backward_func(pp_size=1, vp_size=None)
    for step in range(3):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = schedule(forward_step_func=forward_step, data_iterator=iter([batch]),
                          model=[model], num_microbatches=1, seq_length=config.seq_length,
                          micro_batch_size=4, forward_only=False, pg_collection=language_pgs)
        total, tokens = losses[0]["lm loss"].tolist()
        success, grad_norm, _ = optimizer.step()
        print(f"step {step} loss {total / tokens:.6f} tokens {int(tokens)} "
              f"grad_norm {grad_norm:.6f} success {success}", flush=True)
    dist.destroy_process_group()


def test_colocated_smoke_trains(loader_corpus):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, os.path.abspath(__file__), str(loader_corpus)],
                            cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [line.split() for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(step[-1] == "True" for step in steps)
    losses = [float(step[3]) for step in steps]
    assert abs(losses[0] - math.log(VOCAB)) < 0.2      # random init: about uniform
    assert losses[0] > losses[1] > losses[2]


if __name__ == "__main__":
    main(sys.argv[1])
