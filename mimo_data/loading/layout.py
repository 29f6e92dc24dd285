"""Layouts: which ranks run which module (language model, encoders) with what parallelism, and
what data each rank needs. Pure Python, no torch.distributed: shared by the loader, the trainer
and ``mimo-inspect`` (docs/architecture.md, "Which rank gets what").

A layout names each module with its tp, cp, pp, dp and rank_offset (size = tp*cp*pp*dp)::

    language=tp1,pp2,dp1;image=dp2          # compact string; offsets follow in order
    language=dp2,off0;image=dp2,off0        # colocated: every module on ranks 0..1

    modules:                                  # YAML / dict
      language: {tp: 1, pp: 2, dp: 1}
      image: {dp: 2}                         # rank_offset 2 (after language)
    modalities: {image: images}               # optional: modality -> encoder module

Modalities: a module named ``images``, ``image`` or ``vision`` serves images and one named
``audio`` serves audio, unless said otherwise (``modalities:`` in YAML, a bare ``image`` /
``audio`` field in the compact string, e.g. ``vit=dp2,image``).

Rank order inside a module is megatron-core's ``HyperCommGrid(shape=[tp, cp, dp, pp],
dim_names=["tp", "cp", "dp", "pp"], rank_offset=offset)``, i.e. the order "tp-cp-ep-dp-pp"
with ep=1 and tp fastest::

    rank = offset + tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so the trainer builds its grids with exactly these shapes and names and gets the same groups.

Expert parallelism (``language=tp2,dp4,ep4``, optionally ``etp1``) lays a mixture-of-experts
language model's experts over the same ranks (megatron-core's expert grid
``[etp, ep, expert dp, pp]``): it changes neither a module's size nor the data its ranks get.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
from dataclasses import dataclass, field, replace

import yaml

from mimo_data.errors import listed
from mimo_data.files import load_yaml
from mimo_data.modalities import MODALITIES as REGISTERED

LANGUAGE = "language"          # megatron-core's fixed key for the language module
DIMS = ("tp", "cp", "pp", "dp")
EXPERT_DIMS = ("ep", "etp")     # the expert grid's: not part of a module's size
GRID_DIM_NAMES = ("tp", "cp", "dp", "pp")   # HyperCommGrid dim_names, fastest first
MODALITIES = tuple(REGISTERED)
# Former default module names, still mapped to their modality (with a deprecation message).
DEPRECATED_MODULE_NAMES = {"images": "image", "vision": "image"}
_warned: set[str] = set()


def _default_modality(module: str) -> str | None:
    """The modality a module serves by its name: the modality's own name (``image``)."""
    if module in REGISTERED:
        return module
    modality = DEPRECATED_MODULE_NAMES.get(module)
    if modality and module not in _warned:
        _warned.add(module)
        print(f"mimo: the module name {module!r} is deprecated: name the module {modality!r} "
              f"(or tag it, e.g. '{module}=dp1,{modality}')", file=sys.stderr)
    return modality

# Batch keys (collate.Collator) by what reads them in megatron-core's MimoModel: the language
# model's first stage embeds input_ids, every stage takes position_ids / attention_mask /
# packing_kwargs, the last stage computes the loss; encoders need input_ids to split their
# output per sample (placeholder counts) for the bridge.
LANGUAGE_ALL_STAGES = frozenset({"position_ids", "attention_mask", "packing_kwargs"})
LANGUAGE_FIRST_STAGE = frozenset({"input_ids"})
LANGUAGE_LAST_STAGE = frozenset({"labels", "loss_mask"})
ENCODER_FIRST_STAGE = frozenset({"input_ids"})


class LayoutError(ValueError):
    """A layout that cannot work; the message names the module, the numbers and the fix."""


@dataclass(frozen=True)
class ModuleLayout:
    """One module's parallelism and where its ranks start."""
    name: str
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    rank_offset: int = 0
    # expert parallelism (the language model's mixture-of-experts layers): ``ep`` ranks share
    # each layer's experts, each expert split over ``etp`` ranks (None: the module's tp);
    # megatron-core carves this expert grid out of the same tp x cp x dp ranks, so neither
    # changes the module's size nor what data its ranks get
    ep: int = 1
    etp: int | None = None

    def __post_init__(self):
        for dim in (*DIMS, "rank_offset", *EXPERT_DIMS):
            value = getattr(self, dim)
            if dim == "etp" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or \
                    value < (0 if dim == "rank_offset" else 1):
                raise LayoutError(f"module {self.name!r}: {dim} is {value!r}; it must be an "
                                  f"integer >= {0 if dim == 'rank_offset' else 1}")
        if self.name != LANGUAGE and self.expert_fields:
            given = ",".join(f"{name}{value}" for name, value in self.expert_fields.items())
            raise LayoutError(f"module {self.name!r} has {given}: expert "
                              f"parallelism splits the {LANGUAGE!r} module's "
                              "mixture-of-experts layers; an encoder has none: remove them")
        spread = self.tp * self.cp * self.dp
        if spread % (self.expert_tp * self.ep):
            # ep divides tp x cp x dp: the etp is what to change (left unset it is tp: etp1
            # is offered beside another ep); else the ep, with the etp
            ep_fits = spread % self.ep == 0
            if ep_fits and self.etp is not None:
                remedy = (f"choose an etp that divides {spread // self.ep} (tp x cp x dp / "
                          f"ep{self.ep}), e.g. etp1 (each expert whole on its ranks)")
            elif ep_fits and self.tp > 1 and spread // self.tp > 1:
                remedy = (f"choose an ep that divides {spread // self.tp} (cp x dp, etp being "
                          "tp), or add etp1 to the module (each expert whole on its ranks)")
            elif ep_fits and self.tp > 1:       # cp x dp 1: no ep but 1 would divide it
                remedy = ("add etp1 to the module (each expert whole on its ranks), or raise "
                          "dp")
            else:
                near = max(n for n in range(1, self.ep + 1) if spread % n == 0)
                remedy = (f"choose an ep and an etp whose product divides it, e.g. "
                          f"ep{near},etp1")
            raise LayoutError(
                f"module {self.name!r}: etp{self.expert_tp}"
                f"{' (etp is tp unless given)' if self.etp is None else ''} x ep{self.ep} = "
                f"{self.expert_tp * self.ep} does not divide tp x cp x dp = {spread}: "
                "megatron-core lays each pipeline stage's experts over its tp x cp x dp ranks "
                f"(expert data parallelism takes the rest); {remedy}")

    @property
    def expert_tp(self) -> int:
        """Ranks each expert is split over (``etp``, by default the module's ``tp``)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert in a pipeline stage: tp x cp x dp / (etp x ep)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def expert_fields(self) -> dict[str, int]:
        """``ep`` / ``etp`` where not their defaults (what ``spec`` and ``to_dict`` add)."""
        return {**({"ep": self.ep} if self.ep > 1 else {}),
                **({"etp": self.etp} if self.etp is not None else {})}

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.size)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{tp, cp, dp, pp}`` ranks of global ``rank`` in this module's grid."""
        if rank not in self.ranks:
            raise LayoutError(f"rank {rank} is not in module {self.name!r} (ranks "
                              f"{self.rank_offset}..{self.ranks.stop - 1})")
        local, coords = rank - self.rank_offset, {}
        for dim in GRID_DIM_NAMES:
            coords[dim] = local % getattr(self, dim)
            local //= getattr(self, dim)
        return coords

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at these grid coordinates (inverse of ``coordinates``)."""
        return self.rank_offset + tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def spec(self) -> str:
        experts = "".join(f",{k}{v}" for k, v in self.expert_fields.items())
        return (f"{self.name}=tp{self.tp},cp{self.cp},pp{self.pp},dp{self.dp}{experts},"
                f"off{self.rank_offset}")


@dataclass(frozen=True)
class ModuleRank:
    """A rank's place in one module: grid coordinates and sizes."""
    module: ModuleLayout
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int

    @property
    def name(self) -> str:
        return self.module.name

    @property
    def dp_size(self) -> int:
        return self.module.dp

    @property
    def _stage_index(self) -> int:
        """This rank's place among its pipeline stage's tp x cp x dp ranks (tp fastest)."""
        module = self.module
        return self.tp_rank + module.tp * (self.cp_rank + module.cp * self.dp_rank)

    @property
    def etp_rank(self) -> int:
        """Rank in the expert tensor-parallel group (the expert view's fastest dim)."""
        return self._stage_index % self.module.expert_tp

    @property
    def ep_rank(self) -> int:
        """Rank in the expert-parallel group: it holds experts ``ep_rank * E/ep`` on."""
        return self._stage_index // self.module.expert_tp % self.module.ep

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.module.pp - 1


@dataclass(frozen=True)
class RankRole:
    """What one rank runs and which data it needs.

    ``text_keys``: batch keys the rank needs (empty: no text). ``media``: modalities whose
    encoder inputs it needs. ``text_module``: the module whose DP slice the text tensors follow
    (the language module where the rank has one, else its encoder). A rank that needs neither
    text nor media gets no loader.
    """
    rank: int
    modules: tuple[ModuleRank, ...]
    text_keys: frozenset[str]
    media: dict[str, str]              # modality -> encoder module feeding it on this rank
    text_module: str | None

    @property
    def needs_data(self) -> bool:
        return bool(self.text_keys or self.media)

    def module(self, name: str) -> ModuleRank:
        return next(m for m in self.modules if m.name == name)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "needs_data": self.needs_data,
                "modules": [{"module": m.name, "tp_rank": m.tp_rank, "cp_rank": m.cp_rank,
                             "dp_rank": m.dp_rank, "dp_size": m.dp_size, "pp_rank": m.pp_rank,
                             "pp_size": m.module.pp} for m in self.modules],
                "text_keys": sorted(self.text_keys), "media": dict(sorted(self.media.items())),
                "text_module": self.text_module}


@dataclass(frozen=True)
class Layout:
    """All modules of a run; ``modalities`` maps each modality to the encoder module serving it."""
    modules: tuple[ModuleLayout, ...]
    modalities: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "modules", tuple(self.modules))
        names = [m.name for m in self.modules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise LayoutError(f"module(s) {listed(duplicates)} named twice; give each module once")
        if LANGUAGE not in names:
            close = difflib.get_close_matches(LANGUAGE, names, n=1, cutoff=0.75)
            raise LayoutError(f"no {LANGUAGE!r} module among {listed(names)}" + (
                f" (module {close[0]!r} is named close to it: misspelt?)" if close else "") +
                f": megatron-core's MimoModel needs exactly one module named {LANGUAGE!r}")
        defaults = {n: _default_modality(n) for n in names if n != LANGUAGE}
        mapping = {modality: n for n, modality in defaults.items() if modality}
        mapping.update(self.modalities)
        for modality, module in mapping.items():
            if modality not in MODALITIES:
                raise LayoutError(f"modality {modality!r} unknown; use one of {MODALITIES}")
            if module not in names or module == LANGUAGE:
                raise LayoutError(f"modality {modality!r} is mapped to {module!r}, which is "
                                  f"not an encoder module of this layout ({listed(names)})")
        object.__setattr__(self, "modalities", dict(sorted(mapping.items())))

    # ----------------------------------------------------------------------------- parsing

    @classmethod
    def parse(cls, value) -> Layout:
        """A Layout from a Layout, a dict, a YAML file path or a compact string."""
        if isinstance(value, Layout):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, str) and (value.endswith((".yaml", ".yml")) or
                                       os.path.isfile(value)):
            return cls.from_yaml(value)
        if isinstance(value, str):
            return cls.from_string(value)
        raise LayoutError(f"cannot make a layout of {type(value).__name__} {value!r}")

    @classmethod
    def from_string(cls, text: str) -> Layout:
        """``language=tp1,pp1,dp2;image=dp1,off2`` (missing fields 1, offsets in order)."""
        modules, offset = [], 0
        modalities: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(";"))):
            name, equals, fields_text = part.partition("=")
            name = name.strip()
            if not equals or not re.fullmatch(r"[A-Za-z_][\w-]*", name):
                raise LayoutError(f"layout part {part!r}: write NAME=FIELD,... with fields "
                                  f"tpN, cpN, ppN, dpN, epN, etpN, offN or a modality "
                                  f"({', '.join(MODALITIES)})")
            values: dict[str, int] = {}
            for item in filter(None, (f.strip() for f in fields_text.split(","))):
                if item in MODALITIES:
                    if item in modalities:      # a typo, never meant twice
                        raise LayoutError(
                            f"module {name!r}: {item} is given twice: give it once"
                            if modalities[item] == name else
                            f"{item} is given to {modalities[item]!r} and to {name!r}: one "
                            "module serves it")
                    modalities[item] = name
                    continue
                match = re.fullmatch(r"(tp|cp|pp|dp|ep|etp|off)(\d+)", item)
                bare = re.fullmatch(r"(tp|cp|pp|dp|ep|etp|off)", item)
                if bare:
                    raise LayoutError(f"module {name!r}: field {item!r} needs its number, "
                                      f"e.g. {bare[1]}2")
                if re.fullmatch(r"(vp|vpp)\d*", item):
                    raise LayoutError(f"module {name!r}: {item}: a virtual (interleaved) "
                                      "pipeline is not supported (each stage runs its layers "
                                      "as one chunk, 1F1B); give ppN alone")
                if not match:
                    raise LayoutError(f"module {name!r}: field {item!r} unknown; use tpN, cpN, "
                                      "ppN, dpN, epN (expert parallel), etpN (expert tensor "
                                      "parallel), offN (rank offset) or a modality the module "
                                      f"serves ({', '.join(MODALITIES)})")
                key = "rank_offset" if match[1] == "off" else match[1]
                if key in values:
                    raise LayoutError(f"module {name!r}: {match[1]} is given twice "
                                      f"({match[1]}{values[key]}, {item}): give it once")
                values[key] = int(match[2])
            module = ModuleLayout(name, **{"rank_offset": offset, **values})
            modules.append(module)
            offset = module.ranks.stop
        if not modules:
            raise LayoutError(f"empty layout {text!r}: e.g. 'language=dp2;image=dp1'")
        return cls(tuple(modules), modalities)

    @classmethod
    def from_dict(cls, data: dict) -> Layout:
        """``{"modules": {name: {tp, cp, pp, dp, rank_offset}} | [{name, ...}],
        "modalities": {modality: module}}``; offsets in order where omitted."""
        unknown = set(data) - {"modules", "modalities"}
        if unknown or "modules" not in data:
            raise LayoutError(f"layout keys {listed(sorted(data))}: expected 'modules' (and "
                              "optionally 'modalities'), e.g. {modules: {language: {dp: 2}, "
                              "image: {dp: 1, rank_offset: 0}}}, or the one-line form "
                              "'language=dp2;image=dp1,off0'")
        entries = data["modules"]
        if isinstance(entries, dict):
            entries = [{"name": name, **(values or {})} for name, values in entries.items()]
        modules, offset = [], 0
        for entry in entries:
            entry = dict(entry)
            name = entry.pop("name", None)
            extra = set(entry) - {*DIMS, *EXPERT_DIMS, "rank_offset"}
            if not name or extra:
                raise LayoutError(f"module entry {entry}: needs a name and only "
                                  f"{listed([*DIMS, *EXPERT_DIMS, 'rank_offset'])} "
                                  f"(unknown: {listed(sorted(extra))})")
            module = ModuleLayout(name, **{"rank_offset": offset, **entry})
            modules.append(module)
            offset = module.ranks.stop
        return cls(tuple(modules), dict(data.get("modalities") or {}))

    @classmethod
    def from_yaml(cls, path: str) -> Layout:
        try:
            with open(path) as handle:
                data = load_yaml(handle) or {}
        except yaml.YAMLError as error:
            raise LayoutError(f"{path} is not valid YAML: {error}") from None
        except OSError as error:        # a folder, no permission, gone since it was named
            raise LayoutError(f"cannot read it ({error.strerror or error})") from None
        except UnicodeDecodeError:      # a binary file named as the layout
            raise LayoutError(f"{path} is not UTF-8 text: give a layout YAML") from None
        if "layout" in data and isinstance(data["layout"], (dict, str)):
            data = data["layout"]          # a layout nested in a larger config file
        return cls.parse(data)

    def to_dict(self) -> dict:
        return {"modules": {m.name: {**{d: getattr(m, d) for d in (*DIMS, "rank_offset")},
                                     **m.expert_fields} for m in self.modules},
                "modalities": dict(self.modalities)}

    def __str__(self) -> str:
        return ";".join(",".join([m.spec(), *self.modalities_of(m.name)]) for m in self.modules)

    def compact(self) -> str:
        """The compact string ``from_string`` reads back as this layout, defaults left out
        (expert parallelism's ep and etp after the dims; an offset where a module does not
        start where the one before ends, and every colocated module's ``off0``)."""
        parts, offset = [], 0
        colocated = self.colocated and len(self.modules) > 1
        for m in self.modules:
            dims = [f"{d}{getattr(m, d)}" for d in DIMS if getattr(m, d) > 1] or ["dp1"]
            dims += [f"{d}{v}" for d, v in m.expert_fields.items()]
            if colocated or m.rank_offset != offset:
                dims.append(f"off{m.rank_offset}")
            offset = m.ranks.stop
            tags = [t for t in self.modalities_of(m.name) if t != m.name]
            parts.append(f"{m.name}=" + ",".join(dims + tags))
        return ";".join(parts)

    def on_own_ranks(self) -> Layout:
        """This layout with each encoder module on a rank of its own (dp1, in order) and the
        language module as it is after them: what runs where an encoder cannot share the
        language model's ranks."""
        encoders = [replace(m, tp=1, cp=1, pp=1, dp=1, rank_offset=i)
                    for i, m in enumerate(self.encoders)]
        return Layout((*encoders, replace(self.language, rank_offset=len(encoders))),
                      dict(self.modalities))

    # --------------------------------------------------------------------------- structure

    @property
    def language(self) -> ModuleLayout:
        return self.module(LANGUAGE)

    def module(self, name: str) -> ModuleLayout:
        for module in self.modules:
            if module.name == name:
                return module
        raise LayoutError(f"no module {name!r} in layout {self}")

    @property
    def encoders(self) -> tuple[ModuleLayout, ...]:
        return tuple(m for m in self.modules if m.name != LANGUAGE)

    @property
    def colocated(self) -> bool:
        """All modules on the same ranks (megatron-core's COLOCATED mode)."""
        return len({(m.rank_offset, m.size) for m in self.modules}) == 1

    def fans_in(self, module: ModuleLayout) -> bool:
        """Whether encoder ``module`` feeds the language model from more DP ranks than its,
        on ranks of its own (each language DP rank gets the rows of dp / language dp ranks)."""
        return not self.colocated and module.dp > self.language.dp

    @property
    def world_size(self) -> int:
        return max(m.ranks.stop for m in self.modules)

    def modalities_of(self, module: str) -> list[str]:
        return [modality for modality, name in self.modalities.items() if name == module]

    def global_micro_batch_size(self, micro_batch_size: int) -> int:
        """Samples per global micro-batch: the language module's micro-batch over all its DP
        ranks. Every module splits this same set of samples among its own DP ranks."""
        return micro_batch_size * self.language.dp

    # -------------------------------------------------------------------------- validation

    def validate(self, world_size: int, global_batch_size: int, micro_batch_size: int,
                 variable_count_modalities=(), modalities=None, split_media: bool = False
                 ) -> None:
        """Raise LayoutError unless this layout can run on ``world_size`` ranks with these
        batch sizes. ``variable_count_modalities``: modalities whose per-sample token count
        varies (e.g. dynamic-resolution images, audio). ``modalities``: the modalities the
        preprocessing config expands (each needs an encoder module). ``split_media``
        (``data.split_media``): the encoder modules that fan in read their language rank's
        samples and cut its media, so their dp need not divide the global micro-batch."""
        self._validate_ranks(world_size)
        language = self.language
        for module in self.encoders:
            if not self.modalities_of(module.name):
                raise LayoutError(f"encoder module {module.name!r} serves no modality: name it "
                                  f"after its modality ({'/'.join(MODALITIES)}) or tag it "
                                  f"(e.g. '{module.name}=dp"
                                  f"{module.dp},image'; YAML 'modalities: {{image: "
                                  f"{module.name}}}')")
            small, large = sorted((module.dp, language.dp))
            if large % small:
                raise LayoutError(f"module {module.name!r} has dp {module.dp} and "
                                  f"{LANGUAGE!r} has dp {language.dp}: one must divide the "
                                  "other (the bridge fans each encoder DP rank out to, or in "
                                  "from, a whole number of language DP ranks); change either dp")
        if modalities is not None:
            self.check_serves(modalities)
        self._validate_batches(global_batch_size, micro_batch_size, split_media)
        for modality in variable_count_modalities:
            name = self.modalities.get(modality)
            if name is None:
                continue
            encoder = self.module(name)
            if self.colocated and encoder.dp != language.dp:
                own = self.on_own_ranks()
                fix = (f"Give {name} dp {language.dp}" if language.size == language.dp else
                       f"An encoder runs on dp alone, so it cannot span the {LANGUAGE} module's "
                       f"{language.size} ranks at dp {language.dp}: put it on ranks of its own "
                       f"('{own.compact()}', {own.world_size} ranks)")
                # fixed-resolution images make equal counts; nothing does for clips or speech
                varied = [m for m in variable_count_modalities if self.modalities.get(m) == name]
                fixed = (", or use fixed-resolution images (modalities.image.policy: fixed)"
                         if varied == ["image"] else "")
                raise LayoutError(
                    f"colocated module {name!r} (dp {encoder.dp}) feeds {modality} with a "
                    f"variable token count per sample into {LANGUAGE!r} (dp {language.dp}): "
                    "megatron-core 0.19's colocated bridge splits encoder output evenly, which "
                    f"needs equal token counts per sample. {fix}{fixed}")

    def check_serves(self, modalities) -> None:
        """LayoutError unless the layout serves exactly the modalities the preprocessing
        config expands (``modalities``): each by a module, and no module one it does not."""
        self.check_expanded(modalities)
        for modality in modalities:
            if modality not in self.modalities:
                default = (" (a config without a modalities key expands images and audio: "
                           "'modalities: {}' is text only)" if modality in ("image", "audio")
                           else "")
                serve = ("add video to the module of the tower that takes it (a Qwen-family "
                         "tower serves images and video: 'image=dp1,video;language=dp1')"
                         if modality == "video" else
                         f"add an encoder module (e.g. '{modality}=dp1')")
                # a module named close to the modality ('imag'): a misspelt name, not a
                # missing module
                close = difflib.get_close_matches(
                    modality, [m.name for m in self.encoders], n=1, cutoff=0.75)
                typo = (f" (module {close[0]!r} is named close to {modality!r}: a module "
                        f"named {modality!r} serves {modality})") if close else ""
                raise LayoutError(f"the preprocessing config expands {modality} markers but no "
                                  f"module serves {modality}{typo}: {serve} or "
                                  f"remove modalities.{modality} from the config{default}: "
                                  f"samples with {modality} items are then dropped, and "
                                  "counted")

    def check_expanded(self, modalities) -> None:
        """LayoutError for an encoder module serving a modality outside ``modalities`` (the
        preprocessing config's): no sample holds one, so the module, or that part of it,
        would get nothing to encode."""
        for module in self.encoders:
            served = self.modalities_of(module.name)
            missing = [m for m in served if m not in modalities]
            if missing:
                rest = [m for m in served if m in modalities]
                fix = (f"serve {'/'.join(rest)} alone from it" if rest else
                       "drop the module (its ranks would get no data)")
                raise LayoutError(f"module {module.name!r} serves {'/'.join(missing)}, which "
                                  "the preprocessing config does not expand: add "
                                  f"modalities.{missing[0]} to the config or {fix}")

    def _validate_ranks(self, world_size: int) -> None:
        if self.colocated:
            if self.language.rank_offset != 0 or self.language.size != world_size:
                raise LayoutError(f"colocated layout {self} spans ranks "
                                  f"{self.language.rank_offset}..{self.language.ranks.stop - 1}"
                                  f" but the world has {world_size} ranks: make every module's "
                                  f"tp*cp*pp*dp = {world_size} with offset 0")
            staged = [m for m in self.modules if m.pp > 1]
            if staged and len(self.modules) == 1:
                raise LayoutError(f"module {staged[0].name!r} alone has pp {staged[0].pp}: "
                                  "megatron-core 0.19 runs a model of one module whole on "
                                  "every rank (no pipeline stages); use pp1 (tp, cp or dp "
                                  "for the ranks)")
            if staged:
                raise LayoutError(f"colocated module {staged[0].name!r} has pp "
                                  f"{staged[0].pp}: megatron-core 0.19 runs colocated modules "
                                  "whole on every rank (no pipeline stages); use pp1, or put "
                                  "the modules on separate ranks (non-colocated)")
            return
        spans = sorted(self.modules, key=lambda m: m.rank_offset)
        expected = 0
        for module in spans:
            if module.rank_offset < expected:
                other = next(m for m in spans if m is not module and
                             module.rank_offset in m.ranks)
                # (a colocated layout takes no language context parallelism)
                colocated = "" if any(m.name == LANGUAGE and m.cp > 1 for m in spans) else \
                    ", or put every module on the same ranks (colocated)"
                # every module from here on placed after the one before it: all the offsets
                # to set at once (one at a time, the next overlap came up after each)
                moved, end = [], expected
                for later in spans[spans.index(module):]:
                    start = end                 # (after a gap too: closed)
                    if start != later.rank_offset:
                        moved.append(f"{later.name}'s offset to {start}")
                    end = max(end, start + later.size)
                raise LayoutError(
                    f"module {module.name!r} (ranks {module.rank_offset}..{module.ranks.stop - 1}"
                    f") overlaps {other.name!r} (ranks {other.rank_offset}.."
                    f"{other.ranks.stop - 1}): non-colocated modules need disjoint rank ranges;"
                    f" set {', '.join(moved)} (the world then has {end} ranks){colocated}")
            if module.rank_offset > expected:
                raise LayoutError(f"ranks {expected}..{module.rank_offset - 1} are in no module "
                                  f"(gap before {module.name!r} at offset {module.rank_offset}); "
                                  f"set its offset to {expected}")
            expected = module.ranks.stop
        if expected != world_size:
            sizes = " + ".join(f"{m.name} {m.size}" for m in spans)
            if expected < world_size:
                raise LayoutError(f"ranks {expected}..{world_size - 1} are in no module: the "
                                  f"modules hold {sizes} = {expected} ranks, the world has "
                                  f"{world_size}; grow a module or start {expected} ranks "
                                  f"under torchrun (--nnodes x --nproc-per-node = {expected})")
            raise LayoutError(f"the modules need {sizes} = {expected} ranks, the world has "
                              f"{world_size}; shrink a module or start {expected} ranks "
                              f"under torchrun (--nnodes x --nproc-per-node = {expected})")

    def _validate_batches(self, global_batch_size: int, micro_batch_size: int,
                          split_media: bool = False) -> None:
        if micro_batch_size < 1 or global_batch_size < 1:
            raise LayoutError(f"global batch {global_batch_size} and micro batch "
                              f"{micro_batch_size} must be >= 1")
        group = self.global_micro_batch_size(micro_batch_size)
        if global_batch_size % group:
            raise LayoutError(
                f"global batch {global_batch_size} is not a multiple of micro batch "
                f"{micro_batch_size} x {LANGUAGE} dp {self.language.dp} = {group} (the global "
                f"micro-batch): use a global batch that is a multiple of {group}")
        for module in self.encoders:
            if split_media and self.fans_in(module):
                continue
            if group % module.dp:
                raise LayoutError(
                    f"module {module.name!r} has dp {module.dp}, which does not divide the "
                    f"global micro-batch of {group} sample{'s' if group != 1 else ''} "
                    f"(micro batch {micro_batch_size} x "
                    f"{LANGUAGE} dp {self.language.dp}): every module splits each global "
                    f"micro-batch evenly among its DP ranks; make the micro batch a multiple "
                    f"of {module.dp // math.gcd(module.dp, self.language.dp)} or change "
                    f"{module.name}'s dp" + (
                        "; or let its ranks cut each language rank's media between them "
                        "(data.split_media: true in training; mimo-inspect plan checks it with "
                        "--model TRAIN.yaml beside --layout)" if self.fans_in(module) else ""))

    # ------------------------------------------------------------------------------- roles

    def role(self, rank: int) -> RankRole:
        """What ``rank`` runs and which data it needs (call ``validate`` first)."""
        parts = tuple(ModuleRank(m, **{f"{d}_rank": c for d, c in m.coordinates(rank).items()})
                      for m in self.modules if rank in m.ranks)
        if not parts:
            raise LayoutError(f"rank {rank} is in no module of layout {self}")
        text_keys: set[str] = set()
        media: dict[str, str] = {}
        text_module = None
        for part in parts:
            if part.name == LANGUAGE:
                text_keys |= LANGUAGE_ALL_STAGES
                text_keys |= LANGUAGE_FIRST_STAGE if part.first_stage else set()
                text_keys |= LANGUAGE_LAST_STAGE if part.last_stage else set()
                text_module = LANGUAGE
            elif part.first_stage:
                text_keys |= ENCODER_FIRST_STAGE
                media.update({m: part.name for m in self.modalities_of(part.name)})
                text_module = text_module or part.name
        return RankRole(rank, parts, frozenset(text_keys), media, text_module)

    def roles(self, world_size: int | None = None) -> list[RankRole]:
        return [self.role(rank) for rank in range(world_size or self.world_size)]

