"""mimo_train.mcore's patches and private reaches of megatron-core, one test each.

cpu_compat's (one per megatron-core CUDA assumption it covers): each test runs in a process of
its own without any patch (the patches are process-wide): it makes the megatron-core call that
fails on CPU, checks it fails the way cpu_compat documents, applies only that patch, makes the
same call again and checks the result against a plain-torch reference. The processes are
forked, one per test, from one fresh interpreter that imported torch and megatron-core but not
``mimo_train.mcore`` (whose import applies every patch): its scripts load ``cpu_compat.py`` by
its path (tests/jobs/cpu_compat.py).

The others (``grids.optimizer_groups``, ``distributed_optimizer``, ``async_save``,
``ensure_global_memory_buffer``), which act on the objects mimo gives them rather than process
wide, run in this process (a one-rank gloo world, megatron-core patched as mimo runs it): each
shows what fails without it, then the result with it.
"""

import copy
import inspect
import json
import math
import multiprocessing
import os
import queue
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from support.launch import TESTS, python
from mimo_train.mcore import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the patches apply only when CUDA is absent")

PRELUDE = """
import importlib.util, socket, sys, warnings
import torch, torch.distributed as dist
warnings.filterwarnings("ignore")
assert "mimo_train.mcore" not in sys.modules, "mimo_train.mcore's import applies every patch"
_spec = importlib.util.spec_from_file_location("cpu_compat", CPU_COMPAT_PY)
cpu_compat = importlib.util.module_from_spec(_spec)
sys.modules["cpu_compat"] = cpu_compat
_spec.loader.exec_module(cpu_compat)

def init_gloo():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

def fails(call, match):
    try:
        call()
    except Exception as exc:
        assert match in f"{type(exc).__name__}: {exc}", f"unexpected failure {exc!r}"
        return
    raise AssertionError("expected a failure without the patch")

def ddp_linear():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    world = dist.new_group([0])
    pgs = ProcessGroupCollection(tp=world, cp=world, pp=world, dp=world, dp_cp=world,
                                 tp_dp_cp=world, ep=world, expt_tp=world, expt_dp=world,
                                 intra_dp_cp=world, intra_expt_dp=world, tp_ep_pp=world, mp=world,
                                 embd=world, pos_embd=world)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True)
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(linear.state_dict())
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  linear, pg_collection=pgs)
    return ddp, reference, pgs
"""


SCRIPTS = {      # each test's script after the prelude, by the patch it shows
    "current_device": """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    fails(lambda: rope(6), "NVIDIA driver")
    assert cpu_compat.activate(only=["current_device"]) == ["current_device"]
    emb = rope(6)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    freqs = torch.outer(torch.arange(6, dtype=torch.float32), inv_freq)
    expected = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    assert emb.device.type == "cpu" and torch.allclose(emb, expected)
    """,
    "nccl_groups": """
    init_gloo()
    fails(lambda: dist.new_group([0], backend="nccl"), "only supported with GPUs")
    cpu_compat.activate(only=["nccl_groups"])
    group = dist.new_group([0], backend="nccl")
    assert dist.get_backend(group) == "gloo"
    groups, _ = dist.new_subgroups_by_enumeration([[0]], backend="nccl")
    value = torch.tensor([2.0, 3.0])
    dist.all_reduce(value, group=groups)
    assert value.tolist() == [2.0, 3.0]
    """,
    "causal_masks": """
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func
    softmax = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, False,
                                    attention_mask_func, True, None)
    scores = torch.randn(1, 2, 5, 5)
    fails(lambda: softmax(scores, None), "NVIDIA driver")
    cpu_compat.activate(only=["causal_masks"])
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    expected = torch.softmax(scores.masked_fill(causal, -10000.0), dim=-1)
    assert torch.allclose(softmax(scores, None), expected)
    from megatron.core.transformer import utils
    window = utils.get_sliding_window_causal_mask(4, 4, (1, 0))
    assert window.tolist() == [[False, True, True, True], [False, False, True, True],
                               [True, False, False, True], [True, True, False, False]]
    """,
    "tied_embeddings": """
    from types import SimpleNamespace
    from megatron.core.models.common.language_module.language_module import LanguageModule
    init_gloo()

    class LastStage:            # the last of two pipeline stages, embeddings tied
        pre_process, post_process, share_embeddings_and_output_weights = False, True, True
        vp_stage = vp_size = None
        config = SimpleNamespace(use_mup=False, pipeline_model_parallel_size=2,
                                 mtp_num_layers=0, init_model_with_meta_device=False)
        pp_group = SimpleNamespace(rank=lambda: 1, size=lambda: 2)
        embd_group = dist.group.WORLD
        weight = torch.nn.Parameter(torch.ones(3))

        def shared_embedding_or_output_weight(self):
            return self.weight

        def _is_in_embd_group(self):
            return True

    stage = LastStage()
    fails(lambda: LanguageModule.setup_embeddings_and_output_layer(stage), "NVIDIA driver")
    cpu_compat.activate(only=["tied_embeddings"])
    stage.weight = torch.nn.Parameter(torch.ones(3))
    LanguageModule.setup_embeddings_and_output_layer(stage)
    # zeroed, then filled by the all-reduce with the first stage (alone here: stays zero)
    assert stage.weight.device.type == "cpu" and stage.weight.tolist() == [0.0, 0.0, 0.0]
    assert stage.weight.shared_embedding
    """,
    "streams": """
    init_gloo()
    cpu_compat.activate(only=["current_device"])
    ddp, reference, _ = ddp_linear()
    x = torch.randn(5, 4)
    ddp(x).sum().backward()
    reference(x).sum().backward()
    fails(ddp.finish_grad_sync, "NVIDIA driver")
    cpu_compat.activate(only=["streams"])
    ddp.finish_grad_sync()
    assert torch.allclose(ddp.module.weight.main_grad, reference.weight.grad)
    assert torch.allclose(ddp.module.bias.main_grad, reference.bias.grad)
    """,
    "optimizers": """
    init_gloo()
    cpu_compat.activate(only=["current_device", "streams"])
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ddp, reference, pgs = ddp_linear()
    config = OptimizerConfig(optimizer="adam", lr=0.1, weight_decay=0.0, clip_grad=1.0)
    build = lambda: get_megatron_optimizer(config, [ddp], pg_collection=pgs,
                                           use_gloo_process_groups=False)
    fails(build, "NVIDIA driver")
    cpu_compat.activate(only=["optimizers"])
    optimizer = build()
    initial = reference.weight.detach().clone()
    x = torch.randn(5, 4)
    ddp(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    ddp.finish_grad_sync()
    success, grad_norm, _ = optimizer.step()
    norm = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm()
    assert success and abs(grad_norm - norm.item()) < 1e-5
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    torch.optim.Adam(reference.parameters(), lr=0.1, eps=1e-8).step()   # megatron's default eps
    assert not torch.allclose(reference.weight, initial)
    assert torch.allclose(ddp.module.weight, reference.weight, atol=1e-6)
    assert torch.allclose(ddp.module.bias, reference.bias, atol=1e-6)
    """,
    "schedules": """
    init_gloo()
    cpu_compat.activate(only=["current_device", "streams"])
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules
    ddp, reference, pgs = ddp_linear()
    ddp.module.model_type = ModelType.encoder_or_decoder
    ddp.module.set_input_tensor = lambda tensor: None
    x = torch.randn(5, 4)

    def forward_step(data_iterator, model):
        output = model(next(data_iterator)).pow(2).sum()
        return output, lambda out: (out, {"loss": out.detach()})

    run_schedule = lambda: schedules.forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=iter([x]), model=[ddp],
        num_microbatches=1, seq_length=5, micro_batch_size=5, pg_collection=pgs)
    fails(run_schedule, "NVIDIA driver")
    cpu_compat.activate(only=["schedules"])
    ddp.zero_grad_buffer()
    losses = run_schedule()
    ddp.finish_grad_sync()
    expected = reference(x).pow(2).sum()
    expected.backward()
    assert torch.allclose(losses[0]["loss"], expected.detach())
    assert torch.allclose(ddp.module.weight.main_grad, reference.weight.grad)
    """,
    "recompute_rng": """
    from megatron.core import tensor_parallel
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    recomputed = lambda: tensor_parallel.checkpoint(lambda t: torch.tanh(layer(t)), False, x)
    try:
        recomputed()
        raise AssertionError("expected a failure without the patch")
    except RuntimeError as exc:
        assert "NVIDIA driver" in str(exc) or "CUDA" in str(exc), exc
    cpu_compat.activate(only=["recompute_rng"])
    recomputed().sum().backward()
    grad = layer.weight.grad.clone()
    layer.weight.grad = None
    torch.tanh(layer(x)).sum().backward()
    assert torch.equal(grad, layer.weight.grad)
    """,
    "moe_splits": """
    from megatron.core.transformer.moe import token_dispatcher
    init_gloo()
    # the dispatcher's split sizes after its move to the host, given to the all-to-all as
    # megatron-core's mappings.py gives them (one rank: all to itself)
    splits = lambda: token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3]), as_numpy=True)
    tokens, out = torch.arange(6.0).reshape(3, 2), torch.empty(3, 2)
    exchange = lambda: dist.all_to_all_single(out, tokens, splits(), splits())
    fails(exchange, "incompatible function arguments")
    cpu_compat.activate(only=["moe_splits"])
    exchange()
    assert torch.equal(out, tokens)
    """,
    "uneven_gathers": """
    import os
    from megatron.core.tensor_parallel import mappings
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    child = os.fork()                      # two ranks: this process 0, the child 1
    rank = 0 if child else 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    world = dist.group.WORLD
    cpu_compat.activate(only=["current_device"])           # their buffers' device
    # rank 0 holds one row, rank 1 two (the expert TP ranks' token counts differ)
    mine = torch.full((rank + 1, 2), float(rank + 1))
    gather = lambda: mappings._gather_along_first_dim(mine, world, [1, 2])
    fails(gather, "invalid tensor size")
    cpu_compat.activate(only=["uneven_gathers"])
    assert torch.equal(gather(), torch.tensor([[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]))
    dist.barrier()
    if child == 0:
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0, "rank 1 failed"
    """,
    "rng_tracker": """
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    seed = lambda: model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0,
                                                   force_reset_rng=True)
    fails(seed, "NVIDIA driver")
    cpu_compat.activate(only=["rng_tracker"])
    seed()
    torch.manual_seed(3)
    with tensor_parallel.get_cuda_rng_tracker().fork():      # the model-parallel stream
        forked = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(forked, torch.rand(4))                 # = the CPU generator
    """,
}


@pytest.fixture(scope="module")
def compat(tmp_path_factory):
    """Every test's script run once, each in its own process (tests/jobs/cpu_compat.py); the
    fixture is the check of one of them by name: it exited 0 and printed OK last."""
    tmp = tmp_path_factory.mktemp("cpu-compat")
    prelude = PRELUDE.replace("CPU_COMPAT_PY", repr(str(Path(cpu_compat.__file__))))
    scripts = {}
    for name, body in SCRIPTS.items():
        scripts[name] = tmp / f"{name}.py"
        scripts[name].write_text(prelude + textwrap.dedent(body) + "\nprint('OK')\n")
    python([TESTS / "jobs" / "cpu_compat.py", tmp / "results.json", *scripts.values()],
           timeout=600).check()
    results = json.loads((tmp / "results.json").read_text())

    def check(name: str) -> None:
        result = results[str(scripts[name])]
        assert result["code"] == 0 and result["stdout"].strip().endswith("OK"), \
            f"stdout:\n{result['stdout']}\nstderr:\n{result['stderr'][-4000:]}"
    return check


def test_every_patch_is_documented_and_tested():
    tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
    assert set(cpu_compat.PATCHES) <= tested
    assert all(patch.failure for patch in cpu_compat.PATCHES.values())


def test_activate_does_nothing_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.activate() == []
    with pytest.raises(ValueError, match="unknown cpu_compat patch"):
        cpu_compat.activate(only=["nope"], force=True)


def test_moe_splits(compat):
    compat("moe_splits")


def test_uneven_gathers(compat):
    compat("uneven_gathers")


def test_compiled_methods(monkeypatch):
    """megatron-core's ``@jit_fuser`` methods of the layers mimo builds are torch.compile: on
    the CPU their first call compiles (``fail_on_recompile`` stops at the compile); after the
    patch each is its plain function again and runs without compiling."""
    import importlib

    from megatron.core.jit import jit_fuser
    plain = {}
    for module, owner, names in cpu_compat.COMPILED:
        space = importlib.import_module(module)
        cls = space if owner is None else getattr(space, owner)
        for name in names:
            plain[cls, name] = inspect.unwrap(vars(cls)[name])
            monkeypatch.setattr(cls, name, jit_fuser(plain[cls, name]))
    attention = importlib.import_module("megatron.core.transformer.attention").Attention
    x, gate = torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    with torch.compiler.set_stance("fail_on_recompile"):
        with pytest.raises(RuntimeError, match="Detected recompile"):
            attention._apply_output_gate(None, x, gate)
    monkeypatch.setattr(cpu_compat, "_applied", set())
    assert cpu_compat.activate(only=["compiled_methods"], force=True) == ["compiled_methods"]
    assert all(vars(cls)[name] is function for (cls, name), function in plain.items())
    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(attention._apply_output_gate(None, x, gate), x * torch.sigmoid(gate))


def test_current_device(compat):
    compat("current_device")


def test_nccl_groups(compat):
    compat("nccl_groups")


def test_causal_masks(compat):
    compat("causal_masks")


def test_tied_embeddings(compat):
    compat("tied_embeddings")


def test_streams(compat):
    compat("streams")


def test_optimizers(compat):
    compat("optimizers")


def test_schedules(compat):
    compat("schedules")


def test_rng_tracker(compat):
    compat("rng_tracker")


def test_recompute_rng(compat):
    compat("recompute_rng")


# ------------------------------------------------------------- mcore's other patches and reaches

@pytest.fixture(scope="module")
def language():
    """A one-rank gloo world in this process and the language module of a one-rank layout (its
    grid and process groups: ``mcore.grids``), on which the checks below build megatron-core's
    optimizers."""
    from mimo_data.loading.layout import Layout
    from mimo_train.mcore.grids import build_infra
    from mimo_train.runtime import distributed

    with distributed.alone():
        yield build_infra(Layout.parse("language=dp1"), "gloo").modules["language"]


def _ddp(language):
    """Two seeded linear layers in megatron-core's DDP (for its distributed optimizer)."""
    from mimo_train.mcore import (DistributedDataParallel, DistributedDataParallelConfig,
                                  TransformerConfig)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True)
    return DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), layers,
        pg_collection=language.pgs)


def _adam(ddp, groups):
    """megatron-core's distributed Adam over ``ddp`` on the process groups ``groups``."""
    from mimo_train.mcore import MegatronOptimizerConfig, get_megatron_optimizer
    config = MegatronOptimizerConfig(optimizer="adam", lr=0.1, use_distributed_optimizer=True)
    return get_megatron_optimizer(config, [ddp], pg_collection=groups,
                                  use_gloo_process_groups=False)


def _optimizer(language):
    from mimo_train.mcore.grids import optimizer_groups
    ddp = _ddp(language)
    return ddp, _adam(ddp, optimizer_groups(language.grid))


def _step(ddp, optimizer) -> None:
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    ddp(torch.linspace(-1, 1, 20).reshape(5, 4)).pow(2).sum().backward()
    ddp.finish_grad_sync()
    assert optimizer.step()[0]


def _torch_adam(optimizer):
    (inner,) = optimizer.chained_optimizers
    return inner.optimizer


def _weights(ddp) -> list[torch.Tensor]:
    return [p.detach().clone() for p in ddp.module.parameters()]


def _sharded(language, ddp, optimizer, is_loading: bool) -> dict:
    from mimo_train.components.optimizer_state import OPTIMIZER_METADATA
    model = ddp.sharded_state_dict(metadata={"dp_cp_group": language.pgs.dp_cp})
    return {"optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                      metadata=OPTIMIZER_METADATA)}


@pytest.fixture(scope="module")
def saved(language):
    """The distributed optimizer after two steps, saved as ``components.checkpoint`` saves it
    (megatron-core's fully parallel strategy, its request run in place): the directory, and the
    weights a third step gives."""
    from mimo_train.mcore import (FullyParallelSaveStrategyWrapper, dist_checkpointing,
                                  filesystem_async, get_default_save_sharded_strategy)
    from mimo_train.mcore.async_save import use_forked_write_results
    from mimo_train.mcore.distributed_optimizer import start_adam_states

    ddp, optimizer = _optimizer(language)
    start_adam_states(optimizer)
    _step(ddp, optimizer)
    _step(ddp, optimizer)
    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as directory:
        patch.setattr(filesystem_async, "_results_queue", None)     # this fixture's own
        use_forked_write_results()
        dist_checkpointing.save(
            _sharded(language, ddp, optimizer, is_loading=False), directory,
            FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy()),
            async_sharded_save=True, async_strategy="mcore").execute_sync()
        _step(ddp, optimizer)
        yield directory, _weights(ddp)


def _resumed(language, directory: str, tolerant: bool):
    """A fresh distributed optimizer (``start_adam_states``; ``tolerate_partial_states`` if
    ``tolerant``), its DDP and the state read back from ``directory`` for it to load."""
    from mimo_train.mcore import dist_checkpointing
    from mimo_train.mcore.distributed_optimizer import start_adam_states, tolerate_partial_states

    ddp, optimizer = _optimizer(language)
    start_adam_states(optimizer)
    if tolerant:
        tolerate_partial_states(optimizer)
    loaded = dist_checkpointing.load(_sharded(language, ddp, optimizer, is_loading=True),
                                     directory)
    return ddp, optimizer, loaded["optimizer"]


def test_every_other_patch_is_tested():
    from mimo_train.mcore import async_save, distributed_optimizer, fused_adam
    public = {name for module in (async_save, distributed_optimizer, fused_adam)
              for name, value in vars(module).items() if inspect.isfunction(value)
              and value.__module__ == module.__name__ and not name.startswith("_")}
    tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
    assert public and public | {"optimizer_groups", "ensure_global_memory_buffer"} <= tested


def test_optimizer_groups(language):
    """megatron-core's optimizer without process groups takes ``parallel_state``'s, which mimo
    never initializes (each module has its grid); ``optimizer_groups`` gives it the module's,
    through the helper of megatron-core's ``get_mimo_optimizer``: the grid's own groups."""
    from mimo_train.mcore.grids import optimizer_groups

    ddp = _ddp(language)
    with pytest.raises(AssertionError, match="data parallel group is not initialized"):
        _adam(ddp, None)
    grid = language.grid
    groups = optimizer_groups(grid)
    assert groups.dp is grid.get_pg("dp") and groups.dp_cp is grid.get_pg(["dp", "cp"])
    assert groups.intra_dist_opt is grid.get_pg(["tp", "cp", "dp", "pp"])
    assert groups.expt_dp is grid.get_pg("expt_dp", view="expert")
    _step(ddp, _adam(ddp, groups))


def test_start_adam_states(language):
    """Without TransformerEngine or apex the distributed optimizer's state dict reads Adam's
    step from every parameter's torch state, which Adam makes at its first step: before it the
    state dict (a save, a resume) fails. With the states started, it exists, and the first
    step is the one from a fresh state."""
    from mimo_train.mcore.distributed_optimizer import start_adam_states

    ddp, optimizer = _optimizer(language)
    with pytest.raises(AssertionError):                   # distrib_optimizer.py:839
        optimizer.state_dict()
    start_adam_states(optimizer)
    assert {float(s["step"]) for s in _torch_adam(optimizer).state.values()} == {0.0}
    optimizer.state_dict()
    plain_ddp, plain = _optimizer(language)
    _step(ddp, optimizer)
    _step(plain_ddp, plain)
    assert all(torch.equal(a, b) for a, b in zip(_weights(ddp), _weights(plain_ddp)))


def test_tolerate_partial_states(language, saved):
    """Loading copies every entry of each parameter's torch state from the checkpoint's,
    which has no ``step`` (KeyError), nor, from a checkpoint of the plain optimizer, ``param``
    (``checkpoint.load`` leaves it out). Tolerant, the load takes what there is: the moments
    saved, the main weights kept where the checkpoint has none."""
    directory, _ = saved
    _, optimizer, loaded = _resumed(language, directory, tolerant=False)
    with pytest.raises(KeyError, match="step"):
        optimizer.load_state_dict(loaded)
    _, optimizer, loaded = _resumed(language, directory, tolerant=True)
    expected = copy.deepcopy(loaded["param_state"])
    optimizer.load_state_dict(loaded)
    adam = _torch_adam(optimizer)
    states = [adam.state[p] for group in adam.param_groups for p in group["params"]]
    saved_moments = sorted(float(s["exp_avg"].sum()) for s in expected.values())
    assert sorted(float(s["exp_avg"].sum()) for s in states) == saved_moments
    _, optimizer, loaded = _resumed(language, directory, tolerant=True)
    for state in loaded["param_state"].values():
        del state["param"]
    mains = [p.detach().clone() for group in _torch_adam(optimizer).param_groups
             for p in group["params"]]
    optimizer.load_state_dict(loaded)
    after = [p for group in _torch_adam(optimizer).param_groups for p in group["params"]]
    assert all(torch.equal(a, b) for a, b in zip(mains, after))


def test_unshare_steps(language, saved):
    """A load gives every parameter one and the same step tensor, which Adam increments once
    per parameter: the resumed step counts four steps and its update is not the uninterrupted
    run's. Unshared, it is exactly that."""
    from mimo_train.mcore.distributed_optimizer import unshare_steps

    directory, uninterrupted = saved
    ddp, optimizer, loaded = _resumed(language, directory, tolerant=True)
    optimizer.load_state_dict(loaded)
    states = list(_torch_adam(optimizer).state.values())
    assert len({id(s["step"]) for s in states}) == 1 and len(states) == 4
    _step(ddp, optimizer)
    assert {float(s["step"]) for s in states} == {6.0}
    assert not all(torch.equal(a, b) for a, b in zip(_weights(ddp), uninterrupted))
    ddp, optimizer, loaded = _resumed(language, directory, tolerant=True)
    optimizer.load_state_dict(loaded)
    unshare_steps(optimizer)
    _step(ddp, optimizer)
    assert {float(s["step"]) for s in _torch_adam(optimizer).state.values()} == {3.0}
    assert all(torch.equal(a, b) for a, b in zip(_weights(ddp), uninterrupted))


def test_without_empty_parts(language, monkeypatch):
    """megatron-core aligns an optimizer's parameter groups over the whole world: where a peer
    builds a mixture of experts' optimizer meanwhile (its expert-parallel group gathered here),
    a dense module's gets an expert part holding no parameter, whose state dict asserts
    (distrib_optimizer.py:839) at the first save. Without it the dense part alone steps and
    saves; a module with expert-parallel parameters keeps every part."""
    import megatron.core.optimizer as optimizers

    from mimo_train.mcore.distributed_optimizer import start_adam_states, without_empty_parts
    gather = torch.distributed.all_gather_object

    def with_a_peers_experts(gathered, keys, group=None):
        gather(gathered, keys, group)
        gathered[0] = [*gathered[0], (None, True)]
    monkeypatch.setattr(optimizers.torch.distributed, "all_gather_object", with_a_peers_experts)
    ddp, optimizer = _optimizer(language)
    assert [sum(len(group["params"]) for group in part.param_groups)
            for part in optimizer.chained_optimizers] == [4, 0]
    start_adam_states(optimizer)
    _step(ddp, optimizer)
    with pytest.raises(AssertionError):
        optimizer.chained_optimizers[1].state_dict()
    dense = without_empty_parts(optimizer, ddp.module)
    assert dense.chained_optimizers == optimizer.chained_optimizers[:1]
    _step(ddp, dense)
    assert dense.state_dict()
    ddp.module[0].weight.allreduce = False           # an expert-parallel parameter
    assert without_empty_parts(optimizer, ddp.module) is optimizer


def test_torch_adams(language):
    """The torch Adam of each part of a megatron-core optimizer: the distributed one's, the
    plain fp32 one's; none of another torch optimizer."""
    from mimo_train.mcore import MegatronOptimizerConfig, get_megatron_optimizer
    from mimo_train.mcore.fused_adam import torch_adams
    from mimo_train.mcore.grids import optimizer_groups

    ddp, distributed = _optimizer(language)
    assert torch_adams(distributed) == [(distributed.chained_optimizers[0],
                                         _torch_adam(distributed))]
    ddp = _ddp(language)
    for kind, found in (("adam", torch.optim.AdamW), ("sgd", None)):
        plain = get_megatron_optimizer(MegatronOptimizerConfig(optimizer=kind, lr=0.1), [ddp],
                                       pg_collection=optimizer_groups(language.grid),
                                       use_gloo_process_groups=False)
        adams = [type(adam) for _, adam in torch_adams(plain)]
        assert adams == ([found] if found else []), kind


def test_use_fused_adam(language, saved, monkeypatch):
    """megatron-core builds torch's AdamW with torch's defaults (here a loop over the
    parameters, on a GPU foreach kernels and a copy of the second moments). Fused, each step is
    torch's one fused update (counted), the default's weights within fp32 rounding, the step
    counts on the parameters' device. A load takes the checkpoint's param groups (saved
    unfused): fused again after it, the next step is the uninterrupted run's."""
    from mimo_train.mcore.distributed_optimizer import start_adam_states, unshare_steps
    from mimo_train.mcore.fused_adam import use_fused_adam

    updates = []
    kernel = torch._fused_adamw_

    def counted(*args, **kwargs):
        updates.append(len(args[0]))
        return kernel(*args, **kwargs)
    monkeypatch.setattr(torch, "_fused_adamw_", counted)
    default_ddp, default = _optimizer(language)
    ddp, optimizer = _optimizer(language)
    start_adam_states(optimizer)
    use_fused_adam(optimizer)
    adam = _torch_adam(optimizer)
    assert [(g["fused"], g["foreach"]) for g in adam.param_groups] == [(True, False)] * 2
    for _ in range(3):
        _step(default_ddp, default)
        _step(ddp, optimizer)
    assert updates == [2, 2] * 3, updates      # one kernel call a param group a step
    for fused, plain in zip(_weights(ddp), _weights(default_ddp)):
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-7)
    assert all(s["step"].device == p.device and float(s["step"]) == 3.0
               for p, s in adam.state.items())
    directory, uninterrupted = saved
    ddp, optimizer, loaded = _resumed(language, directory, tolerant=True)
    use_fused_adam(optimizer)
    optimizer.load_state_dict(loaded)
    unshare_steps(optimizer)
    assert not any(g["fused"] for g in _torch_adam(optimizer).param_groups)
    use_fused_adam(optimizer)
    updates.clear()
    _step(ddp, optimizer)
    assert updates and {float(s["step"]) for s in _torch_adam(optimizer).state.values()} == {3.0}
    for fused, plain in zip(_weights(ddp), uninterrupted):
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-7)


class _HostReads(TorchFunctionMode):
    """The tensor methods called under it that read a value on the host (on a GPU each waits
    for the device's queue)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
             torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_optimizer_step_on_device(language):
    """``mcore.optimizer_step.step_on_device``: megatron-core's ``MimoOptimizer`` step with no
    value read on the host (megatron-core's reads its norm, and makes its ranks agree twice,
    each a read). Over three steps (clipping in each: the norm is above 1) and one whose norm
    is below 1 (not clipped) the same norm, weights and Adam moments bit for bit as
    megatron-core's step; then a step with NaN
    gradients and one with infinite ones: flagged 2 and 1, their norms NaN and infinite, and
    no weight, moment or step count moves. An optimizer without torch's fused update (which
    alone skips on the device) is refused before anything moves."""
    from mimo_train.mcore import MimoOptimizer, ModuleOptimizerInfo
    from mimo_train.mcore.fused_adam import use_fused_adam
    from mimo_train.mcore.grids import optimizer_groups
    from mimo_train.mcore.optimizer_step import step_on_device

    def build(fused=True):
        ddp = _ddp(language)
        adam = _adam(ddp, optimizer_groups(language.grid))
        if fused:
            use_fused_adam(adam)
        info = ModuleOptimizerInfo(adam, language.grid, language.pgs, True)
        return ddp, MimoOptimizer({"language": info}, adam.config), _torch_adam(adam)

    def backward(ddp, mimo, scale=1.0):
        ddp.zero_grad_buffer()
        mimo.zero_grad()
        (ddp(torch.linspace(-1, 1, 20).reshape(5, 4)).pow(2).sum() * scale).backward()
        ddp.finish_grad_sync()

    def state(ddp, adam):
        return [*_weights(ddp), *(t.clone() for s in adam.state.values() for t in s.values())]

    (ddp, mimo, adam), (their_ddp, theirs, their_adam) = build(), build()
    for scale in (1.0, 1.0, 1.0, 1e-3):     # the last one's norm below clip_grad: not scaled
        backward(their_ddp, theirs, scale)
        with _HostReads() as megatron:
            success, norm, _ = theirs.step()
        backward(ddp, mimo, scale)
        with _HostReads() as ours:
            outcome = step_on_device(mimo)
        assert success and (norm > 1.0) == (scale == 1.0) and megatron.reads, megatron.reads
        assert not ours.reads and outcome.tolist() == [0.0, norm], (ours.reads, outcome, norm)
        assert all(torch.equal(a, b) for a, b in zip(state(ddp, adam),
                                                     state(their_ddp, their_adam)))
    assert {float(s["step"]) for s in adam.state.values()} == {4.0}
    before = state(ddp, adam)
    for scale, flag, norm in ((math.nan, 2.0, math.nan), (1e38, 1.0, math.inf)):
        backward(ddp, mimo, scale)
        got_flag, got_norm = step_on_device(mimo).tolist()
        assert got_flag == flag and (math.isnan(got_norm) if math.isnan(norm)
                                     else got_norm == norm), (scale, got_flag, got_norm)
        assert all(torch.equal(a, b) for a, b in zip(state(ddp, adam), before))
    ddp, mimo, adam = build(fused=False)
    backward(ddp, mimo)
    weights = _weights(ddp)
    with pytest.raises(RuntimeError, match="torch's fused AdamW"):
        step_on_device(mimo)
    assert all(torch.equal(a, b) for a, b in zip(_weights(ddp), weights))


def test_optimizer_step_on_device_chained_parts(language):
    """A module optimizer whose parts keep their statistics on different groups (a mixture of
    experts' dense and expert parts without the distributed optimizer): its norm squared as
    megatron-core makes it, each part's norm a host float (``x ** 0.5``), then
    ``ChainedOptimizer``'s ``math.sqrt`` of their squares' sum, squared into float32 by
    ``MimoOptimizer``; parts sharing a group: their gradients in one norm. (These gradients'
    squares summed in float32 round one unit differently from megatron-core's float64 path.)"""
    from types import SimpleNamespace

    from mimo_train.mcore.optimizer_step import _norm_squared

    grads = [[torch.tensor([0.534, -2.793]), torch.tensor([-1.544])],
             [torch.tensor([1.784, -0.514])]]
    parts = [SimpleNamespace(get_grads_for_grad_norm=lambda g=g: g,
                             get_grad_stats_parallel_group=lambda: None) for g in grads]
    for shared in (False, True):
        chained = SimpleNamespace(chained_optimizers=parts,
                                  grads_states_parallel_group_is_shared=lambda s=shared: s)
        ours = _norm_squared(chained, torch.device("cpu"))
        if shared:
            every = torch.cat([g.flatten() for part in grads for g in part])
            expected = torch.linalg.vector_norm(every) ** 2
            torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
            continue
        norms = [float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in part])) ** 2) ** 0.5 for part in grads]
        expected = torch.tensor(math.sqrt(sum(x ** 2 for x in norms)) ** 2, dtype=torch.float32)
        assert torch.equal(ours, expected), (ours, expected)


def test_then_in_writer(language):
    """megatron-core's save request is an immutable named tuple (its write cannot be replaced
    in place); the extended request writes, then runs the function, then finalizes (its
    barrier in ``language``'s one-rank world)."""
    from mimo_train.mcore import AsyncRequest
    from mimo_train.mcore.async_save import then_in_writer

    calls: list = []
    request = AsyncRequest(lambda *args, **kwargs: calls.append(("write", args, kwargs)), (1,),
                           [lambda: calls.append("finalize")], async_fn_kwargs={"k": 2})
    with pytest.raises(AttributeError):
        request.async_fn = None               # type: ignore[misc]
    then_in_writer(request, calls.append, "digests").execute_sync()
    assert calls == [("write", (1,), {"k": 2}), "digests", "finalize"]


def test_use_forked_write_results(monkeypatch):
    """megatron-core reads a write's results with ``get_nowait`` once the write returned: in
    the process that wrote (``execute_sync``), or after joining the writer it forked. Its own
    queue is a "spawn" ``Manager``'s (a server process); the writer's queue instead
    (megatron-core's getter returns it, no ``Manager``): an item put is there at once; a forked
    writer's results larger than a pipe holds (a real model's) do not keep it from exiting
    (a pipe-backed queue's did: a hang in megatron-core's join); a writer killed before it put
    anything leaves ``queue.Empty`` (megatron-core: "results_queue should not be empty") at
    once."""
    from mimo_train.mcore import filesystem_async
    from mimo_train.mcore.async_save import use_forked_write_results

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    use_forked_write_results()
    ours = filesystem_async._results_queue

    def no_manager(*args):
        raise AssertionError("megatron-core made its own results queue")
    monkeypatch.setattr(filesystem_async.mp, "get_context", no_manager)
    assert filesystem_async.get_write_results_queue() is ours
    monkeypatch.undo()
    ours.put({"written": 1})                    # in this process (execute_sync)
    assert ours.get_nowait() == {"written": 1}
    with pytest.raises(queue.Empty):
        ours.get_nowait()
    fork = multiprocessing.get_context("fork")
    results = {0: ["x" * 100] * 3000}           # ~300 KB pickled: more than a pipe holds
    for target, args in ((ours.put, (results,)), (os._exit, (9,))):
        writer = fork.Process(target=target, args=args)
        writer.start()
        writer.join(timeout=120)
        alive = writer.is_alive()
        if alive:
            writer.kill()
        assert not alive, "the writer could not exit before its results were read"
        if target is os._exit:                  # killed first: nothing, at once
            with pytest.raises(queue.Empty):
                ours.get_nowait()
        else:
            assert ours.get_nowait() == results


def test_writer_left_nothing(monkeypatch):
    """megatron-core tells only its coordinator which rank's write failed: a rank learns its
    own writer died from its read of the results finding none (once: the flag is cleared); a
    read that found them, or a results queue not mimo's, says nothing of it."""
    from mimo_train.mcore import filesystem_async
    from mimo_train.mcore.async_save import use_forked_write_results, writer_left_nothing

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    use_forked_write_results()
    ours = filesystem_async._results_queue
    ours.put({"written": 1})
    ours.get_nowait()
    assert not writer_left_nothing()
    with pytest.raises(queue.Empty):
        ours.get_nowait()
    assert writer_left_nothing() and not writer_left_nothing()
    monkeypatch.setattr(filesystem_async, "_results_queue", queue.Queue())
    assert not writer_left_nothing()


def test_writer_failure(monkeypatch):
    """A rank learns its own writer's exception (put as the write's results by
    ``then_in_writer``: megatron-core raises it only on its coordinator, where another rank's
    crosses as its text alone) from its read of the results: whole, once (cleared); a read of
    results, or a results queue not mimo's, says none."""
    from mimo_train.mcore import filesystem_async
    from mimo_train.mcore.async_save import use_forked_write_results, writer_failure

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    use_forked_write_results()
    ours = filesystem_async._results_queue
    ours.put(OSError(28, "No space left on device", "ck/step_0000004/__0_0.distcp"))
    assert isinstance(ours.get_nowait(), OSError)
    failure = writer_failure()
    assert isinstance(failure, OSError) and (failure.errno, failure.filename) == (
        28, "ck/step_0000004/__0_0.distcp")
    assert writer_failure() is None
    ours.put({"written": 1})
    ours.get_nowait()
    assert writer_failure() is None
    monkeypatch.setattr(filesystem_async, "_results_queue", queue.Queue())
    assert writer_failure() is None


def test_ensure_global_memory_buffer(monkeypatch):
    """megatron-core's layers take buffers from its global memory buffer, which only its
    ``initialize_model_parallel`` makes (mimo makes the groups of each module's grid)."""
    from mimo_train.mcore import ensure_global_memory_buffer, parallel_state

    monkeypatch.setattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    with pytest.raises(AssertionError, match="global memory buffer is not initialized"):
        parallel_state.get_global_memory_buffer()
    ensure_global_memory_buffer()
    buffer = parallel_state.get_global_memory_buffer()
    ensure_global_memory_buffer()
    assert parallel_state.get_global_memory_buffer() is buffer
