"""mimo_train.mcore.cpu_compat: one test per megatron-core CUDA assumption it covers.

Each test runs in a process of its own without any patch (the patches are process-wide): it
makes the megatron-core call that fails on CPU, checks it fails the way cpu_compat documents,
applies only that patch, makes the same call again and checks the result against a plain-torch
reference. The processes are forked, one per test, from one fresh interpreter that imported
torch and megatron-core but not ``mimo_train.mcore`` (whose import applies every patch): its
scripts load ``cpu_compat.py`` by its path (tests/cpu_compat_run.py).
"""

import json
import textwrap
from pathlib import Path

import pytest
import torch

from launch import TESTS, python
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
    """Every test's script run once, each in its own process (tests/cpu_compat_run.py); the
    fixture is the check of one of them by name: it exited 0 and printed OK last."""
    tmp = tmp_path_factory.mktemp("cpu-compat")
    prelude = PRELUDE.replace("CPU_COMPAT_PY", repr(str(Path(cpu_compat.__file__))))
    scripts = {}
    for name, body in SCRIPTS.items():
        scripts[name] = tmp / f"{name}.py"
        scripts[name].write_text(prelude + textwrap.dedent(body) + "\nprint('OK')\n")
    python([TESTS / "cpu_compat_run.py", tmp / "results.json", *scripts.values()],
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
