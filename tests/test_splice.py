"""mimo_train.mcore.splice: the modalities' rows spliced into the word embeddings without
waiting for the device, against megatron-core's ``MimoModel`` splice on the same ids and rows
(two samples, image and video placeholders): the word embedding called with megatron-core's
ids (so its backward pass is megatron-core's on any device), the same embeddings and
gradients bit for bit; no operator that would wait for a GPU, forward or backward
(``runtime.profile.HostWaits``; megatron-core's has seven); the deepstack parts' placement;
megatron-core's error where a count differs, and placeholders without rows refused. In
process, the language model's embedding stood in for by megatron-core's layout (``[S, B, H]``
of the looked-up rows); the whole models' parity with transformers (``test_vlm*.py``,
``test_qwen3_vl.py``, the GPU check's session run) runs the real one."""

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
    """What the splice reads of its model: the language model's embedding (which records the
    ids it is called with), no partition."""
    partition_adapter = None
    special_token_ids = TOKENS
    _host_ids: torch.Tensor | None = None
    _places = None
    places = SplicingMimoModel.places
    place = SplicingMimoModel.place
    _at = staticmethod(SplicingMimoModel._at)
    get_text_embeddings = SplicingMimoModel.get_text_embeddings
    align_embeddings_by_token_positions = SplicingMimoModel.align_embeddings_by_token_positions

    def __init__(self, weight: torch.Tensor, host_ids: torch.Tensor | None = None):
        self._host_ids = host_ids
        self.looked_up: list[torch.Tensor] = []

        def embed(input_ids, position_ids):      # megatron-core's LanguageModelEmbedding
            self.looked_up.append(input_ids)
            return weight[input_ids].transpose(0, 1).contiguous()
        self.language_model = SimpleNamespace(embedding=embed)


def _inputs():
    ids = torch.tensor([[1, IMAGE, IMAGE, 2, VIDEO, 3],
                        [IMAGE, 4, 5, VIDEO, VIDEO, 6]])
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCABULARY, WIDTH, generator=generator, requires_grad=True)
    rows = {"image": torch.randn(3, WIDTH, generator=generator, requires_grad=True),
            "video": torch.randn(3, WIDTH, generator=generator, requires_grad=True)}
    return ids, weight, rows


def _spliced(model, ids, rows, megatron: bool = False):
    """The splice and the gradients of weights and rows under a fixed probe."""
    positions = torch.arange(ids.size(1)).expand_as(ids)
    splice = MimoModel if megatron else type(model)
    text = splice.get_text_embeddings(model, ids, positions, TOKENS)
    combined = splice.align_embeddings_by_token_positions(model, {**rows, "text": text}, ids,
                                                          TOKENS)
    probe = torch.randn(combined.shape, generator=torch.Generator().manual_seed(1))
    return combined, torch.autograd.grad((combined * probe).sum(), [*rows.values(), text])


def test_the_splice_is_megatron_cores_without_waits():
    ids, weight, rows = _inputs()
    theirs = Spliced(weight)
    with HostWaits() as their_waits:
        expected, expected_grads = _spliced(theirs, ids, rows, megatron=True)
    # the text positions, each part's count (the text's too), each part's masked backward
    assert sum(their_waits.sites.values()) == 1 + 3 + 3, their_waits.sites
    ours = Spliced(weight, ids.clone())
    with HostWaits() as waits:
        found, grads = _spliced(ours, ids, rows)
    assert waits.sites == {}, waits.sites
    assert found.shape == (6, 2, WIDTH) and found.is_contiguous()
    assert torch.equal(found, expected)
    assert found[1, 0].equal(rows["image"][0]) and found[0, 1].equal(rows["image"][2])
    # the embedding gets megatron-core's ids in its order: its backward is megatron-core's
    assert len(ours.looked_up) == len(theirs.looked_up) == 1
    assert torch.equal(ours.looked_up[0], theirs.looked_up[0])
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))


def test_deepstack_parts_go_to_their_placeholders():
    ids, _, rows = _inputs()
    part = rows["video"].detach()
    placed = Spliced(torch.zeros(1), ids).place(part, ids, "video")
    expected = Spliced(torch.zeros(1)).place(part, ids, "video")      # by the device's mask
    assert placed.shape == (6, 2, WIDTH) and torch.equal(placed, expected)
    assert placed[4, 0].equal(part[0]) and placed[3, 1].equal(part[1])
    assert placed[0].abs().sum() == 0


def test_counts_that_differ_from_the_rows_are_refused():
    ids, weight, rows = _inputs()
    with pytest.raises(ValueError, match=r"Number of video tokens \(3\) does not match "
                                         r"number of video embeddings \(2\)"):
        _spliced(Spliced(weight, ids), ids, {**rows, "video": rows["video"][:2]})
    with pytest.raises(ValueError, match=r"Number of video tokens \(3\) does not match "
                                         r"number of video embeddings \(6\)"):       # more
        _spliced(Spliced(weight, ids), ids, {**rows, "video": torch.cat([rows["video"]] * 2)})
    with pytest.raises(ValueError, match="3 video tokens but no video embeddings"):
        _spliced(Spliced(weight, ids), ids, {"image": rows["image"]})
