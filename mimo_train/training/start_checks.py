"""What start-up refuses before anything is built: ranks that read different settings, and
datasets that cannot be trained as given (no index there, a file or Energon's metadata given
for a dataset, one dataset given twice or as a copy), each said in config terms.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch.distributed as dist

from mimo_data.loading.layout import Layout, LayoutError
from mimo_data.loading.loader import (given_twice, held_twice, twice_said,
                                      variable_token_modalities)
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.shards import storage
from mimo_data.shards.cache import environment_cache
from mimo_data.shards.format import INDEX_FILE
from mimo_data.shards.index import DatasetError, index_bytes
from mimo_train.config import TrainConfig
from mimo_train.errors import TrainConfigError
from mimo_train.plan import RunPlan
from mimo_train.runtime import distributed
from mimo_train.runtime.console import PREFIX, say


def differing_settings(plan: RunPlan) -> TrainConfigError | None:
    """The error where the ranks did not all read the same settings (``RunPlan.given``: a
    config edited while the job started, other copies on other nodes), naming the ranks and
    the first keys that differ; None where they agree. Collective: a digest from every rank,
    and only where they differ the settings of the first rank unlike rank 0."""
    mine = plan.given()
    digests = distributed.gather(hashlib.sha256(
        json.dumps(mine, sort_keys=True).encode()).hexdigest())
    if len(set(digests)) == 1:
        return None
    other = next(rank for rank, digest in enumerate(digests) if digest != digests[0])
    first, theirs = distributed.broadcast(mine, src=0), distributed.broadcast(mine, src=other)
    keys = sorted(key for key in first.keys() | theirs.keys()
                  if first.get(key) != theirs.get(key))
    shown = "; ".join(f"{key}: {first.get(key, '(unset)')} vs {theirs.get(key, '(unset)')}"
                      for key in keys[:4]) + (f"; and {len(keys) - 4} more" if len(keys) > 4
                                              else "")
    alike = [rank for rank, digest in enumerate(digests) if digest == digests[0]]
    unlike = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    return TrainConfigError(
        f"the ranks read different settings: rank(s) {alike} and rank(s) {unlike} differ "
        f"(rank 0 vs rank {other}: {shown}): every rank must read the same training and "
        "preprocessing configs; a config edited while the job started, or another copy on "
        "another node? Give every rank the same files and start again")


def check_data(cfg: TrainConfig, preprocess: PreprocessConfig, layout: Layout) -> None:
    """``TrainConfigError`` for datasets that cannot be trained as given (each named with what
    to do: a file or an Energon folder given for a dataset, no index, a copy given twice),
    and for a layout that does not fit the world, the batch sizes or the modalities."""
    _check_each_once(cfg)
    _check_cache_dir(cfg.data.cache_dir)
    for key, directories in (("data.datasets", cfg.data.datasets), ("data.valid", cfg.data.valid)):
        for directory in directories:
            if storage.is_remote(directory):
                try:
                    storage.check_scheme(directory)
                except storage.LocationError as exc:
                    raise TrainConfigError(f"{key}: {exc}") from None
            try:
                there = storage.exists(storage.join(directory, INDEX_FILE),
                                       cfg.data.storage_options)
            except storage.LocationError as exc:      # a misspelt option, said at first use
                raise TrainConfigError(f"data.storage_options: {exc}") from None
            if not there:                   # why not, as every reader of datasets says it
                try:
                    index_bytes(directory, cfg.data.storage_options)
                except DatasetError as error:
                    raise TrainConfigError(f"{key}: {error}") from None
    _check_no_copies(cfg)
    check_layout(cfg, preprocess, layout)


def check_layout(cfg: TrainConfig, preprocess: PreprocessConfig, layout: Layout) -> None:
    """``LayoutError`` for a layout that does not fit the world, the batch sizes or the
    modalities; where it would fit a world of its own size, with the torchrun command that
    starts one (a process started without a launcher)."""
    def validate(world_size: int) -> None:
        layout.validate(world_size, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                        variable_token_modalities(preprocess),
                        modalities=list(preprocess.modalities), split_media=cfg.data.split_media)
    try:
        validate(dist.get_world_size())
    except LayoutError as error:
        try:                # the layout sound on a world of its own size: the launch is amiss
            validate(layout.world_size)
            alone = _alone(layout)
        except LayoutError:
            alone = ""
        raise LayoutError(f"{error}{_uneven_nodes()}{alone}") from None


def _check_cache_dir(root: str | None) -> None:
    """``data.cache_dir`` (where ``MIMO_CACHE_DIR`` does not replace it) a folder this rank
    can keep tables in: said in the config phase, not in the data phase's first write."""
    if not root or environment_cache():
        return
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as error:        # a file in the way, no permission
        raise TrainConfigError(f"data.cache_dir {root} cannot be made ({error.strerror}): give "
                               "a folder this process can write to") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise TrainConfigError(f"data.cache_dir {root} takes no writes (read-only, or not "
                               "this user's): give a folder this process can write to")


def _alone(layout: Layout) -> str:
    """Where one process was started without a launcher (``python -m mimo_train``) for a
    layout of several ranks, how to start them."""
    if "RANK" in os.environ or dist.get_world_size() != 1 or layout.world_size == 1:
        return ""
    return (" (this is one process, started without torchrun; on this machine: torchrun "
            f"--standalone --nproc-per-node {layout.world_size} -m mimo_train ...)")


def _uneven_nodes() -> str:
    """Where torchrun's nodes run different numbers of ranks (a --nproc-per-node given
    otherwise on one node), what to say after a layout's refusal of the world they make."""
    nodes, here = (os.environ.get(name, "") for name in ("GROUP_WORLD_SIZE",
                                                          "LOCAL_WORLD_SIZE"))
    world = dist.get_world_size()
    if not (nodes.isdigit() and here.isdigit()) or int(nodes) * int(here) == world:
        return ""
    return (f" (the world's {world} ranks come from {nodes} nodes, this one running {here}: "
            "the nodes were started with different --nproc-per-node; give each the same)")


def _check_no_copies(cfg: TrainConfig) -> None:
    """``TrainConfigError`` for two directories of one list that hold the same samples
    (``held_twice``: a copy of one dataset, two indexes of the same tars): its samples would
    train (or count) twice an epoch, whatever the paths. A dataset of weight 0 draws nothing:
    not compared."""
    weights = cfg.data.weights or [1.0] * len(cfg.data.datasets)
    drawn = [d for d, weight in zip(cfg.data.datasets, weights) if weight > 0]
    for key, directories in (("data.datasets", drawn), ("data.valid", cfg.data.valid)):
        indexes = []
        for directory in directories if len(directories) > 1 else ():
            index = storage.join(directory, INDEX_FILE)
            try:
                data = storage.read_bytes(index, cfg.data.storage_options)
            except OSError as exc:                  # storage's errors too
                raise TrainConfigError(f"{key}: cannot read {index}: {exc}") from None
            try:
                parsed = json.loads(data)
            except ValueError:      # said by the dataset's own opening
                parsed = None
            indexes.append((directory, hashlib.sha256(data).digest(), parsed))
        copy = held_twice(indexes)
        if copy is not None:
            raise TrainConfigError(
                f"{key} gives {copy.which}: {copy.samples} " + (
                    "would train twice an epoch" if key == "data.datasets" else
                    "would count twice in the validation loss") + f"; {copy.remedy}" + (
                    ", and to draw from it more often, data.weights"
                    if copy.whole and key == "data.datasets" else ""))


def _check_each_once(cfg: TrainConfig) -> None:
    """``TrainConfigError`` for a dataset given twice in ``data.datasets`` (each of its
    samples would train twice an epoch) or in ``data.valid``, also as another spelling of its
    path (a trailing slash, a link); one in both lists is said (a validation loss of trained
    samples: a check that the run fits its data, or a mistake)."""
    for key, directories in (("data.datasets", cfg.data.datasets), ("data.valid", cfg.data.valid)):
        twice = given_twice(list(directories))
        if twice is not None:
            raise TrainConfigError(f"{key} gives {twice_said(*twice)}: each of its samples " + (
                "would train twice an epoch; give it once" + (
                    ", with a larger weight in data.weights to draw from it more often"
                    if cfg.data.weights is not None else
                    " (to draw from it more often, data.weights)")
                if key == "data.datasets" else
                "would count twice in the validation loss; give it once"))
    trained = {storage.canonical(directory): directory for directory in cfg.data.datasets}
    for directory in cfg.data.valid:
        here = storage.canonical(directory)     # one place, any spelling
        if here in trained:
            say(f"{PREFIX}data.valid {directory} is in data.datasets too" + (
                f" (as {trained[here]})" if trained[here] != directory else "") +
                ": the validation loss is of samples the run trains on")
