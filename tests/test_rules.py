"""One set of rules (``mimo_train.plan.rules``): every refusal, enumerated, is refused by the
trainer's start-up (``plan.resolve``, before any process group exists), and the layout advisor
never proposes what the trainer refuses: each case's layout is said not to be ranked, or ranked
only with settings the trainer takes, and every candidate the advisor reports, put into the
training config with its own ``key=value`` overrides, starts (resolves) as it is.

The models are the published replicas (``tools/make_published.py``): a dense Qwen2-VL, a
Qwen3-VL (deepstack rows) and a Qwen3-VL mixture of experts; the advisor reads each as
``mimo-inspect plan --model`` does, from a training YAML, on a small synthetic workload
(nothing trains here; in process, no job).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from conftest import MODELS, REPO
from mimo_data.inspect.advice import AdvisorRequest
from mimo_data.loading.layout import Layout
from mimo_data.loading.loader import variable_token_modalities
from mimo_data.preprocess.config import PreprocessConfig
from mimo_train.config import TrainConfig
from mimo_train.errors import TrainConfigError
from mimo_train.plan import resolve, rules
from mimo_train.planning.advisor import read_model, run_advisor

PUBLISHED = MODELS / "published"
CHECKPOINTS = {"qwen2-vl": PUBLISHED / "Qwen--Qwen2-VL-2B-Instruct",          # 2 layers
               "qwen3-vl": PUBLISHED / "Qwen--Qwen3-VL-2B-Instruct",          # deepstack
               "qwen3-vl-moe": PUBLISHED / "Qwen--Qwen3-VL-30B-A3B-Instruct",  # 8 experts
               "qwen3.5": PUBLISHED / "Qwen--Qwen3.5-4B",     # 2 delta-net key heads
               "qwen3.5-moe": PUBLISHED / "Qwen--Qwen3.5-35B-A3B"}   # 8 experts, no deepstack
MODALITIES = {"image": "image", "video": "image"}       # one tower serves both


@dataclass(frozen=True)
class Case:
    """A config the trainer refuses by one rule: the model, the layout, the other settings,
    what the refusal must say, and what the advisor is asked (the settings it may try)."""
    model: str
    layout: str
    overrides: tuple[str, ...] = ()
    says: str = ""
    request: dict = field(default_factory=dict)
    batch: int = 8            # the advisor's workload: its global batch
    micro: int = 1            # and its micro-batch
    advisor_says: str = ""    # the advisor's reason where the data refuses the layout first


# rule -> a config only that rule refuses (each rule of plan.rules has one: a new rule without
# a case fails test_every_rule_has_a_case)
CASES = {
    "language_layers_split": Case(
        "qwen2-vl", "image=dp1,video;language=pp4", (),
        "2 layers, which do not split into language pp4 (pipeline stages of equal numbers "
        "of whole layers): use pp1 or pp2"),
    "language_heads_split": Case(
        "qwen2-vl", "image=dp1,video;language=tp4", (),
        "2 query groups (key/value heads), which do not split into language tp4: use tp1 or "
        "tp2"),
    "language_mlp_split": Case(
        "qwen3-vl-moe", "image=dp1,video;language=dp5,etp5", (),
        "the language model's experts are 24 wide (the checkpoint's moe_intermediate_size), "
        "which the experts' etp5 does not divide", batch=5),
    "linear_attention_heads_split": Case(
        "qwen3.5", "image=dp1,video;language=tp4", (),
        "gated delta-net layers have 2 key heads, which do not split into language tp4: use "
        "tp1 or tp2"),
    "language_context_parallel_heads": Case(
        "qwen2-vl", "image=dp1,video;language=cp8", (),
        "language cp8 splits each tensor-parallel rank's 4 attention heads (the model's 4 "
        "over tp1) over its context-parallel ranks (mimo's context parallelism is an all-to-all "
        "over heads; ring attention, for heads cp does not divide, is not built): use cp1, cp2 "
        "or cp4"),
    "language_context_parallel_colocated": Case(
        "qwen2-vl", "language=cp2;image=dp2,off0,video", (),
        "language cp2 in a colocated layout: megatron-core's colocated bridge takes no context "
        "parallelism; put the encoders on ranks of their own (e.g. 'image=dp1,video;language=cp2'"
        " on 3 ranks)", micro=2,
        # fixed-size encoder rows only (LLaVA's): Qwen's variable rows are refused colocated
        advisor_says="feeds image with a variable token count per sample"),
    "language_context_parallel_linear_attention": Case(
        "qwen3.5", "image=dp1,video;language=cp4", (),
        "language cp4 splits each tensor-parallel rank's 2 gated delta-net key heads (the "
        "model's 2 over tp1) over its context-parallel ranks (all-to-all over heads): use cp1 or "
        "cp2"),
    "encoders_run_whole": Case(
        "qwen2-vl", "image=tp2,video;language=dp1", (),
        "encoder module 'image' has tp 2"),
    "split_media_needs_fan_in": Case(
        "qwen3-vl", "image=dp1,video;language=dp1", ("data.split_media=true",),
        "data.split_media cuts each language rank's media over the encoder ranks that fan in "
        "to it; this layout has none"),
    "sequence_parallel_needs_tp": Case(
        "qwen2-vl", "image=dp1,video;language=dp1", ("model.language.sequence_parallel=true",),
        "sequence_parallel needs the language model's tensor parallelism"),
    "sequence_parallel_unpacked": Case(
        "qwen2-vl", "image=dp1,video;language=tp2",
        ("model.language.sequence_parallel=true", "data.packing=true"),
        "sequence_parallel with data.packing"),
    "lora_rank_splits_over_tp": Case(
        "qwen2-vl", "image=dp1,video;language=tp2", ("model.lora.language.rank=3",),
        "rank 3 does not split over the language model's tp 2"),
    "deepstack_projection": Case(
        "qwen3-vl", "image=dp1,video;language=dp1", ("model.encoders.image.projection=linear",),
        "projection linear (model.encoders.<module>.projection, else model.projection) cannot "
        "map them"),
    "deepstack_full_recompute": Case(
        "qwen3-vl", "image=dp1,video;language=dp1", ("model.language.recompute=full",),
        "model.language.recompute full would recompute without them",
        {"recompute": "full"}),
    "experts_need_sequence_parallel": Case(
        "qwen3-vl-moe", "image=dp1,video;language=tp2", (),
        "trains under tensor parallelism (the layout's language tp2) only with sequence "
        "parallelism", {"sequence_parallel": False}),
    "expert_parallel_needs_experts": Case(
        "qwen3-vl", "image=dp1,video;language=dp2,ep2", (),
        "the layout gives the language module ep2, expert parallelism, but its layers are "
        "dense"),
    "balancing_loss_needs_experts": Case(
        "qwen3-vl", "image=dp1,video;language=dp1", ("model.language.moe_aux_loss=0.01",),
        "a mixture of experts' load-balancing loss, but the language model's layers are dense"),
    "balancing_loss_not_fully_recomputed": Case(
        "qwen3.5-moe", "image=dp1,video;language=dp1",
        ("model.language.moe_aux_loss=0.01", "model.language.recompute=full"),
        "model.language.recompute full runs the layers again in the backward pass",
        {"recompute": "full"}),
    "experts_split_over_ep": Case(
        "qwen3-vl-moe", "image=dp1,video;language=dp3,ep3", (),
        "experts per layer, which do not split over the layout's language ep3", batch=6),
    "expert_lora_rank_splits_over_etp": Case(
        "qwen3-vl-moe", "image=dp1,video;language=dp4,etp2",
        ("model.lora.language.rank=3", "model.lora.language.targets=[linear_fc1]"),
        "rank 3 does not split over the experts' etp 2"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, PreprocessConfig]]:
    """model name -> (its preprocessing config file, the config), as mimo-train
    --preprocessing-for writes it."""
    from mimo_train.families.registry import preprocessing_for
    tmp = tmp_path_factory.mktemp("rules")
    found = {}
    for name, checkpoint in CHECKPOINTS.items():
        if not (checkpoint / ".complete").is_file():
            pytest.fail(f"{checkpoint} is not built: run tools/setup.sh")
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**preprocessing_for(str(checkpoint)),
                                        "seq_length": 1024}))
        found[name] = (path, PreprocessConfig.from_yaml(str(path)))
    return found


def _training_yaml(tmp_path: Path, models: dict, case: Case) -> Path:
    """The case's model and settings as a training YAML (its layout given apart)."""
    preprocess, _ = models[case.model]
    overrides = [f"data.datasets=[{tmp_path}]", f"data.preprocess={preprocess}",
                 f"model.pretrained={CHECKPOINTS[case.model]}", *case.overrides]
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(TrainConfig.load(None, overrides).to_dict()))
    return path


def _workload(packing: bool, batch: int = 8, micro: int = 1) -> dict:
    """Two steps of ``batch`` samples of 200 tokens and up, each with a 4 x 4 image, in
    micro-batches of ``micro``."""
    return {"global_batch_size": batch, "micro_batch_size": micro, "seq_length": 1024,
            "packing": packing, "epochs": 1, "vocab_size": 151_700, "modalities": MODALITIES,
            "steps": [[{"tokens": 200 + 20 * i, "trained": 200 + 20 * i, "items": {"image": [16]},
                        "grids": {"image": [[1, 4, 4]]}} for i in range(batch)]
                      for _ in range(2)]}


def _advice(path: Path, models: dict, case: Case, layout: str | None, gpus: int) -> dict:
    """The advisor's report on the case's model, asked as the case says."""
    preprocess, config = models[case.model]
    model = read_model(str(path), str(preprocess), config, MODALITIES, "bf16")
    request = AdvisorRequest(str(path), str(preprocess), gpus, gpu="h200", layout=layout,
                             top=1000, **case.request)
    return run_advisor(model, _workload(bool(model.packing), case.batch, case.micro), request,
                       variable_token_modalities(config), list(config.modalities))


def test_every_rule_has_a_case():
    assert set(CASES) == set(rules.RULES)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_the_trainer_refuses_at_start_up(rule, models, tmp_path):
    case = CASES[rule]
    cfg = TrainConfig.load(str(_training_yaml(tmp_path, models, case)),
                           [f"layout={case.layout}"])
    with pytest.raises(TrainConfigError) as refused:
        resolve(cfg)
    assert case.says in str(refused.value)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_the_advisor_never_proposes_what_the_trainer_refuses(rule, models, tmp_path):
    """Asked about the case's model, with the case's layout as yours: the layout is not
    ranked with the trainer's own reason, or ranked only with other settings; and every
    candidate it reports (ranked or dropped for memory) starts as the trainer takes it."""
    case = CASES[rule]
    path = _training_yaml(tmp_path, models, case)
    layout = Layout.parse(case.layout)
    try:
        report = _advice(path, models, case, case.layout, layout.world_size)
    except TrainConfigError as error:      # the model itself is refused: nothing is proposed
        assert case.says in str(error)
        return
    yours = [r for r in report["ranked"] if r["layout_full"] == str(layout)]
    says = case.advisor_says or case.says
    assert (says in (report["yours_not_ranked"] or "")) != bool(yours), report
    for result in report["ranked"] + report["dropped"]:
        resolve(TrainConfig.load(str(path), result["overrides"]))


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_every_proposal_on_eight_gpus_starts(name, models, tmp_path):
    """Every ranked layout of each model on 8 GPUs, with its settings, packed or not."""
    for packing in (False, True):
        case = Case(name, "language=dp1", (f"data.packing={str(packing).lower()}",))
        path = _training_yaml(tmp_path, models, case)
        report = _advice(path, models, case, None, 8)
        assert report["ranked"], report
        for result in report["ranked"]:
            resolve(TrainConfig.load(str(path), result["overrides"]))


def test_the_distributed_optimizer_counts_the_experts_ranks(models, tmp_path):
    """The start-up line's "nothing to shard" for a distributed optimizer over one rank of
    dp x cp: not for a mixture whose experts are spread over fewer ranks than tp (etp1 at
    tp2: two expert-data-parallel ranks share each expert's state, most of such a model's)."""
    case = Case("qwen3-vl-moe", "", ("data.packing=false", "optimizer.distributed=true",
                                     "model.language.sequence_parallel=true"))
    path = _training_yaml(tmp_path, models, case)
    for layout, said in (("tp2,etp1", "language: distributed optimizer, sequence parallel"),
                         ("tp2", "language: distributed optimizer (dp x cp 1: nothing to "
                                 "shard), sequence parallel")):
        plan = resolve(TrainConfig.load(str(path), [f"layout=image=dp1,video;language={layout}"]))
        assert said in plan.memory_summary().split("; "), plan.memory_summary()


def test_an_mlp_that_tp_cannot_split_is_refused(tmp_path):
    """The dense MLP of a model trained from scratch (its case's model is a mixture of
    experts: the published replicas' dense MLPs split over any tp their heads allow), and a
    shared expert's width: megatron-core would assert while building the layers."""
    cfg = TrainConfig.load(str(REPO / "configs" / "train" / "images_language_noncolocated.yaml"),
                           [f"data.datasets=[{tmp_path}]", "layout=image=dp1;language=tp2",
                            "model.language.ffn_hidden_size=131"])
    with pytest.raises(TrainConfigError, match="the language model's MLP is 131 wide .* "
                       "set model.language.ffn_hidden_size to a multiple of 2"):
        resolve(cfg)
    facts = rules.Facts(2, 4, 2, experts=8, expert_mlp=24, shared_expert_mlp=33)
    [refusal] = rules.refusals(facts, Layout.parse("language=tp2,etp1"), rules.Settings(
        sequence_parallel=True))
    assert "shared expert is 33 wide" in refusal.reason


@pytest.mark.parametrize("targets", ["[linear_qkv, shared_experts.linear_fc1]", "[all-linear]"])
def test_lora_on_a_mixture_of_experts_is_refused_only_where_it_reaches_routed_experts(
        targets, models, tmp_path):
    """The expert rule's case with targets that leave the routed experts out (the attention
    and a shared expert's layer; all-linear, PEFT's: no routed expert) starts; the rule reads
    the part's targets."""
    case = CASES["expert_lora_rank_splits_over_etp"]
    case = Case(case.model, case.layout, (case.overrides[0],
                                          f"model.lora.language.targets={targets}"))
    cfg = TrainConfig.load(str(_training_yaml(tmp_path, models, case)),
                           [f"layout={case.layout}"])
    plan = resolve(cfg)
    assert plan.settings.lora_targets == {"language": tuple(yaml.safe_load(targets))}
    assert rules.refusals(plan.facts, plan.layout, plan.settings) == []


def test_a_packed_mixture_of_experts_under_tp_is_told_to_drop_packing_or_tp():
    """With data.packing (which sequence parallelism does not run with), the fix for a
    mixture of experts under tensor parallelism is tp1 or no packing, not sequence
    parallelism alone."""
    from mimo_data.loading.layout import Layout
    from mimo_train.plan.rules import Facts, Settings, experts_need_sequence_parallel
    facts, layout = Facts(4, 4, 2, experts=8), Layout.parse("language=tp2")
    assert experts_need_sequence_parallel(facts, layout, Settings(packing=True)).endswith(
        "only with sequence parallelism: use tp1, or drop data.packing (which sequence "
        "parallelism does not run with at cp1) and set model.language.sequence_parallel=true")
    assert experts_need_sequence_parallel(facts, layout, Settings()).endswith(
        "set model.language.sequence_parallel=true, or tp1")
    # under context parallelism a packed row is padded to cp x tp: sequence parallelism runs
    # with packing, so it is the fix, and the packed rule takes it
    cp = Layout.parse("language=tp2,cp2")
    assert experts_need_sequence_parallel(facts, cp, Settings(packing=True)).endswith(
        "set model.language.sequence_parallel=true, or tp1")
    assert rules.refusals(facts, cp, Settings(packing=True, sequence_parallel=True)) == []


def test_encoders_named_to_a_layout_without_encoder_modules_say_so():
    """A layout of the language model alone with model.encoders set: said as no encoder
    modules (not "use its encoder modules" and an empty list)."""
    from mimo_train.plan.parts import check_module_names
    with pytest.raises(TrainConfigError, match=r"model\.encoders has image, which the layout "
                       r".* does not name: it has no encoder modules: leave model\.encoders "
                       r"out, or give the layout a module for each"):
        check_module_names("model.encoders", ["image"], Layout.parse("language=dp2"),
                           encoders_only=True)
