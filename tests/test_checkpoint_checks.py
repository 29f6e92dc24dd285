"""What ``checkpoint.check`` refuses before a tensor is read, in process on the tensors' names
(the multi-rank checks of a resumed run are in tests/test_train_run.py)."""

from __future__ import annotations

import pytest

from mimo_train.errors import CheckpointError


def test_a_checkpoint_with_a_projection_the_model_lacks_is_refused():
    """Saved with a linear projection after the image tower (a config of before per-module
    projections: model.projection linear beside a whole VLM), resumed with the VLM's own
    (none): its trained projection would be dropped without a word."""
    from mimo_train.components.checkpoint import _check_projections
    image = "modality_submodules.image.module."
    wanted = {f"{image}encoders.image.encoder.model.merger.mlp.0.weight": (8, 8),
              "language_model.module.embedding.word_embeddings.weight": (32, 8)}
    saved = {**wanted, f"{image}input_projections.0.0.weight": None,
             f"{image}input_projections.0.0.bias": None,
             f"optimizer.state.exp_avg.{image}input_projections.0.0.weight": None}
    meta = {"config": {"model": {"projection": "linear", "encoders": {}}}}
    with pytest.raises(CheckpointError, match=r"holds projection weights of module 'image' "
                       r"that this run's model lacks, e.g. \['modality_submodules.image.module."
                       r"input_projections.0.0.bias', .*its config: \{'model.projection': "
                       r"'linear', 'model.encoders.image.projection': None\}"):
        _check_projections("ckpt", wanted, saved, meta)
    # the same kind as the model's: nothing to say; another module's: not this rank's to check
    _check_projections("ckpt", {**wanted, f"{image}input_projections.0.0.weight": (8, 8),
                                f"{image}input_projections.0.0.bias": (8,)}, saved, meta)
    _check_projections("ckpt", {"language_model.module.embedding.word_embeddings.weight":
                                (32, 8)}, saved, meta)
