"""megatron-core, as mimo_train uses it: the gateway. Only this package imports megatron-core.

Importing it first filters the known third-party warnings (``runtime.console``), then, when
CUDA is absent, applies ``cpu_compat`` (megatron-core 0.19.2 on CPU with gloo), and only then
imports megatron-core: every name below is the patched one. Every patch of megatron-core and
every reach into its private names is in this package, the patches each with a test of what
fails without it (tests/test_train_cpu_compat.py); no module outside imports megatron-core,
a private name from here, reads a private attribute of what it gives or patches it
(tests/test_architecture.py). Here: ``ensure_global_memory_buffer``. Beside it:
``cpu_compat`` (CUDA assumptions), ``grids`` (each module's process groups, its optimizer's),
``distributed_optimizer`` (its torch Adam's states without TransformerEngine or apex),
``fused_adam`` (torch's fused AdamW under its optimizers without them),
``multi_tensor`` (its gradient norm and clipping on torch's foreach kernels without them),
``grad_accumulation`` (DDP's small gradients into their buffers in multi-tensor additions),
``wgrad_fusion`` (the linear layers' weight gradients into their buffers by their GEMMs),
``optimizer_step`` (``MimoOptimizer``'s step with nothing read on the host),
``async_save`` (the checkpoint writer's request and results), ``attention`` (the language
model's core attention), ``bridge_routing`` (variable token counts across module bridges),
``splice`` (the rows into the word embeddings without host reads), ``deepstack``,
``rotary`` (interleaved M-RoPE), ``norms`` (sequence-parallel norms), ``delta_rule`` (the
gated delta-net kernels, per sample when packed), ``balance`` (a mixture of experts'
load-balancing loss over the global batch), ``grouped_experts`` (its experts as grouped
GEMMs), ``language_loss`` (the output layer and loss at the trained tokens, in chunks) and
``gated_delta_net`` (megatron-core's gated delta-net layer without fla; its import, below,
patches megatron-core's module for it where needed).
"""

from __future__ import annotations

from mimo_train.runtime import console
from mimo_train.mcore import cpu_compat

console.quiet_third_party()
CPU_PATCHES = cpu_compat.activate()           # [] with CUDA: megatron-core runs unchanged

# ruff: noqa: E402  (the imports must follow the patches)
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import (extract_matching_values, merge,
                                                        nested_values)
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedBase,
                                                     ShardedObject, ShardedTensor)
from megatron.core.dist_checkpointing.serialization import (get_default_save_sharded_strategy,
                                                            load_plain_tensors)
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper)
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       finalize_model_grads)
from megatron.core.enums import ModelType
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.mimo import (AudioModalitySubmodules, MimoModel, MimoModelConfig,
                                       VisionModalitySubmodules, get_mimo_optimizer)
from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo
from megatron.core.models.mimo.optimizer import (  # noqa: F401  (for grids alone)
    _get_pg_collection_for_optimizer)
from megatron.core.optimizer import (ChainedOptimizer, DistributedOptimizer,
                                     get_megatron_optimizer)
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer.optimizer import param_group_identifier_keys
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator
from megatron.core.pipeline_parallel.multimodule_communicator import (
    MultiModulePipelineCommunicator)
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.process_groups_config import (MultiModuleProcessGroupCollection,
                                                 ProcessGroupCollection)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.tensor_parallel.random import (get_cuda_rng_tracker,
                                                  model_parallel_cuda_manual_seed)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

from mimo_train.mcore.gated_delta_net import GatedDeltaNet, GatedNorm, saved_in_sections
from mimo_train.mcore import grad_accumulation, multi_tensor, rope_fusion, wgrad_fusion

FOREACH_NORM = multi_tensor.install()   # without TransformerEngine and apex (always, here)
ROPE_FUSION = rope_fusion.install()     # the attention's rotary, one fused formula a tensor
grad_accumulation.install()             # DDP's small gradients, one addition a pass
wgrad_fusion.install()                  # gradient_accumulation_fusion without apex

__all__ = [
    "CPU_PATCHES", "AsyncCallsQueue", "AsyncRequest", "AudioModalitySubmodules",
    "BridgeCommunicator", "ChainedOptimizer", "DistributedOptimizer",
    "ColumnParallelLinear", "RowParallelLinear", "apply_swiglu_sharded_factory",
    "DistributedDataParallel", "DistributedDataParallelConfig", "DotProductAttention",
    "FullyParallelSaveStrategyWrapper",
    "GatedDeltaNet", "GatedNorm", "GPTModel", "HyperCommGrid",
    "LocalNonpersistentObject", "MegatronOptimizerConfig", "MimoModel", "MimoModelConfig",
    "MimoOptimizer", "ModuleOptimizerInfo", "filesystem_async",
    "get_megatron_optimizer", "ensure_global_memory_buffer",
    "ModelType", "ModuleSpec", "MultiModulePipelineCommunicator",
    "MultiModuleProcessGroupCollection", "OptimizerParamScheduler", "ProcessGroupCollection",
    "ShardedBase", "ShardedObject", "ShardedTensor", "StrictHandling", "TransformerConfig",
    "VisionModalitySubmodules", "dist_checkpointing", "extract_matching_values",
    "finalize_model_grads", "get_cuda_rng_tracker", "get_default_save_sharded_strategy",
    "get_forward_backward_func",
    "get_gpt_layer_local_spec",
    "get_mimo_optimizer", "load_plain_tensors",
    "make_tp_sharded_tensor_for_checkpoint", "merge", "model_parallel_cuda_manual_seed",
    "nested_values", "param_group_identifier_keys", "parallel_state", "saved_in_sections",
    "scatter_to_sequence_parallel_region"]


def ensure_global_memory_buffer() -> None:
    """megatron-core's global memory buffer, which its layers expect and only its
    ``initialize_model_parallel`` sets (mimo makes each module's groups with ``HyperCommGrid``
    instead): set once a process."""
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
