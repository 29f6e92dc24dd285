"""mimo_train.mcore.splice: the modalities' rows spliced into the word embeddings without a
host read of the device, against megatron-core's ``MimoModel`` splice on the same ids and rows
(two samples, image and video placeholders): the same embeddings and gradients bit for bit;
no operator that would wait for a GPU (``runtime.profile.HostWaits``; megatron-core's has
them); megatron-core's error where a count differs, and placeholders without rows refused.
In process, the language model's embedding stood in for by megatron-core's layout (``[S, B,
H]`` of the looked-up rows); the whole models' parity with transformers (``test_vlm*.py``,
the GPU check's session run) runs the real one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mimo_train.mcore import MimoModel
from mimo_train.mcore.splice import SplicingMimoModel
from mimo_train.runtime.profile import HostWaits

VOCABULARY, WIDTH, IMAGE, VIDEO = 16, 4, 7, 8
TOKENS = {"image": IMAGE, "video": VIDEO}


class Spliced:
    """What the splice reads of its model: the language model's embedding, no partition."""
    partition_adapter = None
    _host_ids: torch.Tensor | None = None
    get_text_embeddings = SplicingMimoModel.get_text_embeddings
    align_embeddings_by_token_positions = SplicingMimoModel.align_embeddings_by_token_positions
    _placeholders = SplicingMimoModel._placeholders

    def __init__(self, weight: torch.Tensor):
        # megatron-core's LanguageModelEmbedding: the rows of the ids, [S, B, H]
        embed = lambda input_ids, position_ids: weight[input_ids].transpose(0, 1).contiguous()  # noqa: E731
        self.language_model = SimpleNamespace(embedding=embed)


def _inputs():
    ids = torch.tensor([[1, IMAGE, IMAGE, 2, VIDEO, 3],
                        [IMAGE, 4, 5, VIDEO, VIDEO, 6]])
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCABULARY, WIDTH, generator=generator, requires_grad=True)
    rows = {"image": torch.randn(3, WIDTH, generator=generator, requires_grad=True),
            "video": torch.randn(3, WIDTH, generator=generator, requires_grad=True)}
    return ids, weight, rows


def _splice(model, ids, rows):
    positions = torch.arange(ids.size(1)).expand_as(ids)
    embeddings = {**rows, "text": model.get_text_embeddings(ids, positions, TOKENS)}
    return model.align_embeddings_by_token_positions(embeddings, ids, TOKENS)


def _gradients(combined, weight, rows):
    probe = torch.randn(combined.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((combined * probe).sum(), [weight, *rows.values()])
    return grads


def test_the_splice_is_megatron_cores_without_waits():
    ids, weight, rows = _inputs()
    reference = Spliced(weight)
    with HostWaits() as theirs:
        expected = _splice_megatron(reference, ids, rows)
    assert sum(theirs.sites.values()) >= 3, theirs.sites    # text positions, each count
    ours = Spliced(weight)
    ours._host_ids = ids.clone()
    with HostWaits() as waits:
        found = _splice(ours, ids, rows)
    assert waits.sites == {}, waits.sites
    assert found.shape == (6, 2, WIDTH) and found.is_contiguous()
    assert torch.equal(found, expected)
    assert found[1, 0].equal(rows["image"][0]) and found[0, 1].equal(rows["image"][2])
    for ours_grad, their_grad in zip(_gradients(found, weight, rows),
                                     _gradients(expected, weight, rows)):
        assert torch.equal(ours_grad, their_grad)
    # without the host's ids it counts on the device, as megatron-core does: the same rows
    assert torch.equal(_splice(Spliced(weight), ids, rows), expected)


def _splice_megatron(model, ids, rows):
    positions = torch.arange(ids.size(1)).expand_as(ids)
    text = MimoModel.get_text_embeddings(model, ids, positions, TOKENS)
    return MimoModel.align_embeddings_by_token_positions(model, {**rows, "text": text}, ids,
                                                         TOKENS)


def test_counts_that_differ_from_the_rows_are_refused():
    ids, weight, rows = _inputs()
    model = Spliced(weight)
    model._host_ids = ids
    with pytest.raises(ValueError, match=r"Number of video tokens \(3\) does not match "
                                         r"number of video embeddings \(2\)"):
        _splice(model, ids, {**rows, "video": rows["video"][:2]})
    with pytest.raises(ValueError, match="3 video tokens but no video embeddings"):
        _splice(model, ids, {"image": rows["image"]})
