"""Layouts: parsing (compact string, YAML, dict), every validation error, rank roles, and the rank
order checked against megatron-core's own HyperCommGrid."""

from __future__ import annotations

import itertools

import pytest

from mimo_data.loading.layout import Layout, LayoutError, ModuleLayout


def test_compact_string_defaults_offsets_and_modalities():
    layout = Layout.from_string("language=tp2,pp2,dp2; image=dp1 ;vit=cp2,image;audio=off9")
    language, images, vit, audio = layout.modules
    assert (language.tp, language.cp, language.pp, language.dp) == (2, 1, 2, 2)
    assert language.size == 8 and language.rank_offset == 0
    assert (images.rank_offset, images.size) == (8, 1)
    assert (vit.rank_offset, vit.cp, vit.size) == (9, 2, 2)
    assert audio.rank_offset == 9             # an explicit offset wins
    assert layout.modalities == {"image": "vit", "audio": "audio"}   # the tag beats the name
    assert Layout.from_string(str(layout)) == layout


def test_yaml_and_dict_forms_equal_the_string_form(tmp_path):
    path = tmp_path / "layout.yaml"
    path.write_text("modules:\n  language: {pp: 2, dp: 1}\n  encoder: {dp: 2}\n"
                    "modalities: {image: encoder}\n")
    from_yaml = Layout.parse(str(path))
    from_list = Layout.from_dict({"modules": [{"name": "language", "pp": 2},
                                              {"name": "encoder", "dp": 2, "rank_offset": 2}],
                                  "modalities": {"image": "encoder"}})
    assert from_yaml == from_list == Layout.parse("language=pp2;encoder=dp2,image")
    assert from_yaml.module("encoder").rank_offset == 2
    assert Layout.from_dict(from_yaml.to_dict()) == from_yaml
    nested = tmp_path / "run.yaml"
    nested.write_text("layout: 'language=pp2;encoder=dp2,image'\n")
    assert Layout.parse(str(nested)) == from_yaml
    # a module given twice: a LayoutError (a usage error, one line), not YAML's last one kept
    twice = tmp_path / "twice.yaml"
    twice.write_text("modules:\n  language: {pp: 2}\n  language: {dp: 2}\n")
    with pytest.raises(LayoutError, match="twice.yaml is not valid YAML: the key 'language' "
                       "is given twice"):
        Layout.parse(str(twice))
    # the modules as a mapping of their one-line forms (a natural guess): the shape shown
    with pytest.raises(LayoutError, match=r"layout keys image, language: expected 'modules' .*"
                       r"e\.g\. \{modules: \{language: \{dp: 2\}, image: \{dp: 1, "
                       r"rank_offset: 0\}\}\}, or the one-line form"):
        Layout.from_dict({"language": "dp1", "image": "dp1,off0"})


@pytest.mark.parametrize("text, words", [
    ("", ["empty"]),
    ("language=dp2;image=xx3", ["image", "xx3", "(image, audio, video)"]),
    ("language=dp0", ["language", "dp", "0"]),
    ("image=dp1", ["language"]),
    ("language=dp1;language=dp1", ["language", "twice"]),
    ("language dp1", ["NAME=FIELD"]),
    ("language=tp1,dp;image=dp1", ["module 'language': field 'dp' needs its number, e.g. dp2"]),
    ("language=pp2,vp2;image=dp1", ["module 'language': vp2: a virtual (interleaved) pipeline "
                                    "is not supported", "give ppN alone"]),
    # a field or a modality given twice, never the last one kept (cp2,cp1: no cp at all)
    ("image=dp1,video;language=cp2,cp1", ["module 'language': cp is given twice (cp2, cp1)"]),
    ("image=dp1,video,video;language=dp1", ["module 'image': video is given twice"]),
    ("image=dp1,video;language=dp1,video", ["video is given to 'image' and to 'language'"]),
])
def test_malformed_layouts_are_refused_with_what_to_write(text, words):
    with pytest.raises(LayoutError) as error:
        Layout.from_string(text)
    for word in words:
        assert word in str(error.value)


def test_colocated_versus_non_colocated():
    assert Layout.parse("language=dp2;image=dp2,off0").colocated
    assert not Layout.parse("language=dp2;image=dp2").colocated
    assert Layout.parse("language=dp1").colocated


def _error(layout, world, global_batch=8, micro=1, variable=(), modalities=None) -> str:
    with pytest.raises(LayoutError) as error:
        Layout.parse(layout).validate(world, global_batch, micro, variable, modalities)
    return str(error.value)


def test_ranks_in_no_module():
    message = _error("language=dp2;image=dp1", 5)
    assert "ranks 3..4 are in no module" in message and "5" in message
    message = _error("language=dp2;image=dp1,off3", 4)
    assert "ranks 2..2 are in no module" in message and "image" in message
    assert "set its offset to 2" in message


def test_overlapping_ranges():
    message = _error("language=dp2;image=dp2,off1", 3)
    assert "'image'" in message and "overlaps 'language'" in message
    assert message.endswith("set image's offset to 2 (the world then has 4 ranks), or "
                            "put every module on the same ranks (colocated)"), message
    # with language context parallelism, which a colocated layout does not take: the offset
    # alone
    message = _error("language=cp2;image=dp1,off0", 2)
    assert message.endswith("set image's offset to 2 (the world then has 3 ranks)"), message
    # two modules on the language model's ranks: both offsets at once, the layout they make
    # sound (one at a time, the second overlap came up after the first was mended)
    message = _error("language=tp2,dp1;image=dp1,off0;audio=dp1,off0", 2)
    assert "set image's offset to 2, audio's offset to 3 (the world then has 4 ranks)" in \
        message, message
    Layout.parse("language=tp2,dp1;image=dp1,off2;audio=dp1,off3").validate(4, 8, 1, (), None)
    # a module after a gap: the offsets said close it too (followed, no gap refused next)
    message = _error("image=dp2,off0;audio=dp1,off1;language=dp2,off4", 6)
    assert "set audio's offset to 2, language's offset to 3 (the world then has 5 ranks)" in \
        message, message
    Layout.parse("image=dp2,off0;audio=dp1,off2;language=dp2,off3").validate(5, 8, 1, (), None)


def test_a_tower_cannot_share_the_ranks_of_a_split_language_model():
    """Colocated, an encoder (dp alone) would need the language model's dp over as many ranks:
    the message gives the layout with the tower on a rank of its own, which validates."""
    message = _error("language=cp2;image=dp2,video,off0", 2, micro=2, variable=["image", "video"])
    assert "cannot span the language module's 2 ranks at dp 1" in message
    assert "put it on ranks of its own ('image=dp1,video;language=cp2', 3 ranks)" in message
    assert "Give image" not in message
    # fixed-resolution images would not make a clip's count equal: not offered for a video tower
    assert "policy: fixed" not in message
    Layout.parse("image=dp1,video;language=cp2").validate(3, 2, 2, ["image", "video"])
    message = _error("language=dp2;image=tp2,off0", 2, micro=2, variable=["image"])
    assert "Give image dp 2, or use fixed-resolution images (modalities.image.policy: fixed)" \
        in message


@pytest.mark.parametrize("text", ["image=dp1,video;language=cp2",
                                  "language=dp1,off1;image=dp1,off0",
                                  "language=dp2,ep2;image=dp2,off0,video",
                                  "language=tp2,pp2,dp2,ep2,etp1;image=dp4,off8;audio=dp2,off12"])
def test_the_compact_string_reads_back_as_the_layout(text):
    layout = Layout.parse(text)
    assert Layout.parse(layout.compact()) == layout


def test_more_ranks_than_the_world():
    message = _error("language=dp4;image=dp2", 4)
    assert "language 4 + image 2 = 6" in message and "world has 4" in message
    assert "colocated" in _error("language=dp2,off0;image=dp2,off0", 4)
    message = _error("language=pp2,off0;image=dp2,off0", 2, micro=2)
    assert "'language' has pp 2" in message and "non-colocated" in message
    # a language model alone: one module, run as colocated (no stages) by megatron-core
    message = _error("language=tp2,pp2", 4, micro=2)
    assert "'language' alone has pp 2" in message and "use pp1" in message


def test_dp_sizes_must_divide_each_other():
    message = _error("language=dp2;image=dp3", 5, global_batch=12, micro=3)
    assert "'image' has dp 3" in message and "'language' has dp 2" in message
    assert "divide" in message


def test_global_batch_must_be_a_multiple_of_the_global_micro_batch():
    message = _error("language=dp2;image=dp1", 3, global_batch=10, micro=4)
    assert "global batch 10" in message and "4 x language dp 2 = 8" in message


def test_every_module_dp_must_divide_the_global_micro_batch():
    message = _error("language=dp1;image=dp2", 3, global_batch=8, micro=1)
    assert "'image' has dp 2" in message and "global micro-batch of 1" in message
    assert "multiple of 2" in message
    # a module fanning in (ranks of its own, more of them): the media split is named too
    assert message.endswith("; or let its ranks cut each language rank's media between them "
                            "(data.split_media: true in training; mimo-inspect plan checks it "
                            "with --model TRAIN.yaml beside --layout)")
    colocated = _error("language=tp2,dp2,off0;image=dp4,off0", 4, micro=1, global_batch=2)
    assert "'image' has dp 4" in colocated and "split_media" not in colocated
    Layout.parse("language=dp1;image=dp2").validate(3, 8, 2)      # micro 2: fine


def test_fan_in_and_fan_out_take_variable_token_counts():
    """Non-colocated bridges route per-sample counts both ways (mimo_train.mcore.bridge_routing)."""
    Layout.parse("language=dp1;image=dp2").validate(3, 8, 2, ["image"])   # fan-in
    Layout.parse("language=tp2;image=dp4;audio=dp2").validate(8, 8, 4, ["image", "audio"])
    Layout.parse("language=dp2;image=dp1").validate(3, 8, 2, ["image"])   # fan-out


def test_colocated_heterogeneous_dp_with_variable_token_counts_is_refused():
    message = _error("language=dp2,off0;image=tp2,dp1,off0", 2, micro=2, variable=["image"])
    assert "colocated" in message and "'image' (dp 1)" in message


def test_modalities_need_an_encoder_and_encoders_need_a_modality():
    message = _error("language=dp1;image=dp1", 2, modalities=["image", "audio"])
    assert "audio" in message and "no module serves audio" in message
    assert "add an encoder module (e.g. 'audio=dp1')" in message
    assert "or remove modalities.audio from the config" in message and message.endswith(
        ": samples with audio items are then dropped, and counted")
    # videos go to the tower that takes them, not to a module of their own
    message = _error("language=dp1;image=dp1", 2, modalities=["image", "video"])
    assert "no module serves video: add video to the module of the tower that takes it (a " \
        "Qwen-family tower serves images and video: 'image=dp1,video;language=dp1')" in message
    message = _error("language=dp1;tower=dp1", 2)
    assert "'tower' serves no modality" in message and "tower=dp1,image" in message
    # a misspelt module name serving another modality: the name is pointed at
    message = _error("imag=dp1,video;language=dp1", 2, modalities=["image", "video"])
    assert "no module serves image (module 'imag' is named close to 'image': a module named " \
        "'image' serves image): add an encoder module" in message
    # and a module serving what the preprocessing never expands would get nothing: refused
    # (mimo-inspect plan and the dry run as mimo_train's config phase)
    assert _error("language=dp2;image=dp1;audio=dp1;video=dp1", 5, modalities=[
        "image", "audio"]) == "module 'video' serves video, which the preprocessing config " \
        "does not expand: add modalities.video to the config or drop the module (its ranks " \
        "would get no data)"
    assert _error("language=dp1;image=dp1,video", 2, modalities=["image"]).endswith(
        "add modalities.video to the config or serve image alone from it")


def test_roles_of_a_non_colocated_pipeline_layout():
    layout = Layout.parse("language=tp2,pp2,dp1;image=pp2,dp2")
    layout.validate(8, 8, 2, [], ["image"])        # fan-in
    roles = layout.roles()
    first, last = roles[0], roles[2]
    assert first.module("language").pp_rank == 0 and last.module("language").pp_rank == 1
    assert "input_ids" in first.text_keys and "labels" not in first.text_keys
    assert {"labels", "loss_mask"} <= last.text_keys and "input_ids" not in last.text_keys
    assert all("position_ids" in roles[r].text_keys for r in range(4))
    assert all(not roles[r].media for r in range(4))
    encoder_stage0 = [r for r in roles[4:] if r.module("image").pp_rank == 0]
    encoder_stage1 = [r for r in roles[4:] if r.module("image").pp_rank == 1]
    assert [r.rank for r in encoder_stage0] == [4, 5] and [r.rank for r in encoder_stage1] == [6, 7]
    assert all(r.media == {"image": "image"} and r.text_keys == {"input_ids"}
               for r in encoder_stage0)
    assert not any(r.needs_data for r in encoder_stage1)
    assert [r.module("image").dp_rank for r in encoder_stage0] == [0, 1]


def test_colocated_roles_hold_every_module():
    layout = Layout.parse("language=dp2,off0;image=dp1,tp2,off0")
    role = layout.role(1)
    assert [m.name for m in role.modules] == ["language", "image"]
    assert role.module("language").dp_rank == 1 and role.module("image").tp_rank == 1
    assert role.text_module == "language" and role.media == {"image": "image"}


@pytest.mark.parametrize("spec", [dict(tp=2, cp=1, dp=2, pp=2, rank_offset=3),
                                  dict(tp=1, cp=2, dp=3, pp=2, rank_offset=0),
                                  dict(tp=3, cp=2, dp=1, pp=1, rank_offset=5)])
def test_rank_order_is_megatron_hyper_comm_grid_order(spec, monkeypatch):
    hyper_comm_grid = pytest.importorskip("megatron.core.hyper_comm_grid")
    module = ModuleLayout("language", **spec)
    monkeypatch.setenv("WORLD_SIZE", str(module.ranks.stop))
    grid = hyper_comm_grid.HyperCommGrid([spec["tp"], spec["cp"], spec["dp"], spec["pp"]],
                                         ["tp", "cp", "dp", "pp"],
                                         rank_offset=spec["rank_offset"])
    for dim in ("tp", "cp", "dp", "pp"):
        for group in grid.get_rank_enum(dim):
            coords = [module.coordinates(rank) for rank in group]
            # One group varies exactly ``dim``, in order, and holds the other coordinates.
            assert [c[dim] for c in coords] == list(range(spec[dim]))
            others = {tuple(v for k, v in c.items() if k != dim) for c in coords}
            assert len(others) == 1
    for rank in module.ranks:
        assert module.rank_of(**module.coordinates(rank)) == rank
    assert sorted(itertools.chain.from_iterable(grid.get_rank_enum("dp"))) == list(module.ranks)


def test_expert_parallelism_parses_and_keeps_the_module_size(tmp_path):
    layout = Layout.from_string("language=tp2,dp4,ep4,etp1;image=dp2")
    language = layout.language
    assert (language.ep, language.etp, language.expert_tp, language.expert_dp) == (4, 1, 1, 2)
    assert language.size == 8 and layout.module("image").rank_offset == 8
    assert Layout.from_string(str(layout)) == layout == Layout.from_dict(layout.to_dict())
    assert Layout.from_string("language=tp2,dp2").language.expert_tp == 2    # etp: tp's
    assert "ep" not in Layout.from_string("language=dp2").to_dict()["modules"]["language"]


@pytest.mark.parametrize("text, words", [
    ("language=tp2,dp2,ep8", ["etp2 (etp is tp unless given) x ep8 = 16", "tp x cp x dp = 4"]),
    # etp left to be tp, where etp1 would fit: that is offered (ep2 x etp1 divides tp2), and
    # with cp x dp 1 no ep "that divides 1" (no expert parallelism at all)
    ("language=tp2,ep2", ["etp2 (etp is tp unless given) x ep2 = 4 does not divide tp x cp x "
                          "dp = 2", "; add etp1 to the module (each expert whole on its "
                          "ranks), or raise dp"]),
    ("language=tp2,dp2,ep4", ["etp2 (etp is tp unless given) x ep4 = 8 does not divide tp x cp "
                              "x dp = 4", "choose an ep that divides 2 (cp x dp, etp being tp)"]),
    ("language=dp2,ep4,etp2", ["choose an ep and an etp whose product divides it, e.g. "
                               "ep2,etp1"]),
    ("language=dp4,ep3", ["ep3", "does not divide"]),
    # etp given over what fits beside the ep: the etp is what to change, not the ep
    ("language=dp2,ep2,etp2", ["etp2 x ep2 = 4 does not divide tp x cp x dp = 2",
                               "choose an etp that divides 1 (tp x cp x dp / ep2), e.g. etp1"]),
    ("language=dp2;image=dp2,ep2", ["module 'image' has ep2: expert", "encoder has none"]),
    # said so where its ep would not fit its ranks either, not as an ep to choose
    ("language=dp2;image=dp1,ep2", ["'image'", "encoder has none"]),
])
def test_expert_layouts_megatron_cannot_lay_out_are_refused(text, words):
    with pytest.raises(LayoutError) as error:
        Layout.from_string(text).validate(4, 8, 1)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("spec", [dict(tp=2, dp=2, pp=2, ep=2), dict(tp=2, dp=4, ep=4, etp=1),
                                  dict(tp=1, cp=2, dp=2, ep=2, pp=2, rank_offset=3)])
def test_expert_groups_are_megatron_parallel_state_groups(spec, monkeypatch):
    """The trainer's expert view (``grids.expert_view``) gives the expert groups
    megatron-core's own ``RankGenerator`` gives for ``order="tp-ep-dp-pp"``."""
    hyper_comm_grid = pytest.importorskip("megatron.core.hyper_comm_grid")
    from megatron.core.parallel_state import RankGenerator
    from mimo_train.mcore.grids import expert_view
    module = ModuleLayout("language", **spec)
    monkeypatch.setenv("WORLD_SIZE", str(module.ranks.stop))
    grid = hyper_comm_grid.HyperCommGrid([module.tp, module.cp, module.dp, module.pp],
                                         ["tp", "cp", "dp", "pp"],
                                         rank_offset=module.rank_offset)
    shape, names = expert_view(module)
    grid.register_view("expert", shape=shape, dim_names=names, shared_dims=["pp"])
    megatron = RankGenerator(tp=module.expert_tp, ep=module.ep, dp=module.expert_dp,
                             pp=module.pp, cp=1, order="tp-ep-dp-pp",
                             rank_offset=module.rank_offset)
    for ours, theirs in (("expt_tp", "tp"), ("ep", "ep"), ("expt_dp", "dp"),
                         (["expt_tp", "ep"], "tp-ep")):
        assert sorted(grid.get_rank_enum(ours, view="expert")) == \
            sorted(megatron.get_ranks(theirs)), (spec, ours)
    # a rank's ep / etp rank (which experts and which slice of each it imports) is its place
    # in megatron-core's ep / expert-tp group
    layout = Layout((module,))
    for dim, field in (("ep", "ep_rank"), ("tp", "etp_rank")):
        for group in megatron.get_ranks(dim):
            assert [getattr(layout.role(r).module("language"), field) for r in group] == \
                list(range(len(group))), (spec, dim, group)
