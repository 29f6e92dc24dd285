"""The language model's output layer and loss at the trained tokens only, in chunks of them
(``model.language.loss_chunk_tokens``, ``mcore.language_loss``) against megatron-core's own path
(``output_layer`` and ``compute_language_model_loss``: every token's logits at once) with the
same weights, in process on a one-rank gloo world, fp32: the trained tokens' loss (an
untrained token's is 0), the hidden states' gradient and every parameter's gradient, for all
of them at once (the default), chunks that divide them, that do not (the last one shorter) and
one chunk larger than them; the embedding tied to the output layer or not, rows past the
predicted vocabulary (a checkpoint's, padded) or not; the output layer frozen (LoRA's case: no
weight gradient made); a micro-batch with no trained token; bf16 within its precision; no
gradient made without autograd; on the CPU, an output gradient that is not a scalar times the
trained tokens refused; the output layer's matmuls made on the trained rows alone.

Under layouts, in chunks against their colocated steps (all trained tokens at once), as cases
of existing jobs: language tp2 with sequence parallelism and language pp2, a packed fan-in
(``test_train_parity.py``), a tied checkpoint under pp2 (``test_hf_language.py``), LoRA on a
tied checkpoint under tp2 (``test_lora.py``), a pretrained VLM's padded vocabulary under tp2,
packed (``test_vlm.py``); every model's loss against transformers' (``test_hf_language.py``,
``test_vlm*.py``, ``test_published_checkpoints.py``) goes through it. The memory model's count
of it: ``test_planning.py``.
"""

from __future__ import annotations

import pytest
import torch

HIDDEN, ROWS, TOKENS, BATCH = 16, 96, 12, 2            # 24 tokens a micro-batch


@pytest.fixture(scope="module")
def groups():
    from mimo_data.loading.layout import Layout
    from mimo_train.mcore import ensure_global_memory_buffer
    from mimo_train.mcore.grids import build_infra
    from mimo_train.runtime import distributed

    with distributed.alone():
        ensure_global_memory_buffer()
        yield build_infra(Layout.parse("language=dp1"), "gloo").modules["language"].pgs


def _model(groups, chunk: int, tied: bool, vocabulary: int, dtype=torch.float32):
    from mimo_train.mcore import TransformerConfig
    from mimo_train.mcore.layer_specs import language_block_spec
    from mimo_train.model.build import _SeededGPTModel

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
        calculate_per_token_loss=True, attention_dropout=0.0, hidden_dropout=0.0,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, bias_activation_fusion=False,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        params_dtype=dtype, bf16=dtype == torch.bfloat16)
    model = _SeededGPTModel(
        seed=1, vocabulary=vocabulary, loss_chunk_tokens=chunk, packed_rows=False,
        config=config, transformer_layer_spec=language_block_spec(config, backend="local"),
        vocab_size=ROWS, max_sequence_length=64, position_embedding_type="rope",
        share_embeddings_and_output_weights=tied, pg_collection=groups)
    return model.to(dtype)


def _batch(vocabulary: int, dtype=torch.float32):
    """Hidden states ``[s, b, h]`` (the decoder's input), labels with untrained tokens (-100)
    and the loss mask (1 exactly where labels are trained)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, BATCH, HIDDEN, generator=generator).to(dtype)
    labels = torch.randint(0, vocabulary, (BATCH, TOKENS), generator=generator)
    labels[0, :3] = -100
    labels[1, 7] = -100
    return hidden, labels, (labels != -100).float()


def _forward(model, hidden, labels, megatron: bool = False):
    """The per-token loss; ``megatron``: through megatron-core's own path (its ``GPTModel``'s
    forward, without mimo's loss)."""
    from mimo_train.model.build import LanguageModel
    forward = LanguageModel.forward if megatron else type(model).forward
    return forward(model, input_ids=None, position_ids=torch.arange(TOKENS).expand(BATCH, -1),
                   attention_mask=None, decoder_input=hidden, labels=labels)


def _step(model, hidden, labels, mask, megatron: bool = False):
    """The trained tokens' per-token loss (the others' 0), the hidden states' gradient and
    every parameter's, of the masked summed loss (``training.step.loss_func``'s)."""
    hidden = hidden.clone().requires_grad_()
    model.zero_grad()
    loss = _forward(model, hidden, labels, megatron)
    (loss.float() * mask).sum().backward()
    return (loss * mask).detach(), hidden.grad, {name: p.grad.clone() for name, p in
                                                 model.named_parameters() if p.grad is not None}


def _pair(groups, chunk: int, tied: bool, vocabulary: int, dtype=torch.float32):
    """The model for megatron-core's path and mimo's with ``chunk``, the same weights."""
    plain = _model(groups, 0, tied, vocabulary, dtype)
    chunked = _model(groups, chunk, tied, vocabulary, dtype)
    chunked.load_state_dict(plain.state_dict())
    return plain, chunked


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("vocabulary", [ROWS, 90], ids=["all-rows", "padded-rows"])
@pytest.mark.parametrize("chunk", [0, 6, 5, 100],
                         ids=["all-at-once", "partial-last", "dividing", "one"])
def test_language_loss_and_gradients_are_megatron_cores(groups, chunk, tied, vocabulary):
    """20 trained tokens of 24 all at once, in chunks of 6 (the last of 2), of 5, or one chunk
    larger than them."""
    plain, chunked = _pair(groups, chunk, tied, vocabulary)
    batch = _batch(vocabulary)
    loss, hidden_grad, grads = _step(plain, *batch, megatron=True)
    found_loss, found_hidden_grad, found_grads = _step(chunked, *batch)
    torch.testing.assert_close(found_loss, loss, rtol=1e-6, atol=1e-6)
    assert loss.shape == (BATCH, TOKENS) and found_loss.dtype == torch.float32
    torch.testing.assert_close(found_hidden_grad, hidden_grad, rtol=1e-5, atol=1e-7)
    assert found_grads.keys() == grads.keys()
    assert ("output_layer.weight" in grads) != tied
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(found_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # the output rows past the vocabulary never enter a softmax: no gradient
    if vocabulary < ROWS and not tied:
        assert not found_grads["output_layer.weight"][vocabulary:].any()


def test_a_frozen_output_layer_gets_no_gradient(groups):
    """LoRA keeps the output layer (and a tied embedding) fixed: the chunked loss then makes
    no weight gradient, and the hidden states' is unchanged."""
    plain, chunked = _pair(groups, 5, True, ROWS)
    for model in (plain, chunked):
        model.embedding.word_embeddings.weight.requires_grad_(False)
    batch = _batch(ROWS)
    loss, hidden_grad, grads = _step(plain, *batch, megatron=True)
    found_loss, found_hidden_grad, found_grads = _step(chunked, *batch)
    torch.testing.assert_close(found_loss, loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(found_hidden_grad, hidden_grad, rtol=1e-5, atol=1e-7)
    assert "embedding.word_embeddings.weight" not in found_grads
    assert found_grads.keys() == grads.keys()


def test_bf16_is_megatron_cores_within_its_precision(groups, monkeypatch):
    """bf16 weights and hidden states (the chunks' weight gradients summed in fp32, 40 output
    rows at a time here, then rounded once, as one matmul over all tokens does): the loss and
    gradients of the unchunked bf16 step within a few bf16 roundings."""
    from mimo_train.mcore import language_loss
    monkeypatch.setattr(language_loss, "_ROWS", 40)          # 96 rows: 40, 40 and 16
    plain, chunked = _pair(groups, 5, False, 90, torch.bfloat16)
    batch = _batch(90, torch.bfloat16)
    loss, hidden_grad, grads = _step(plain, *batch, megatron=True)
    found_loss, found_hidden_grad, found_grads = _step(chunked, *batch)
    # measured: the loss and the hidden states' gradient equal, the weights' within 5.6e-3 of
    # their largest entry (bf16's epsilon is 3.9e-3)
    torch.testing.assert_close(found_loss, loss, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(found_hidden_grad.float(), hidden_grad.float(), rtol=1e-2,
                               atol=1e-5)
    for name, grad in grads.items():
        scale = grad.float().abs().max()
        assert (found_grads[name].float() - grad.float()).abs().max() <= 2e-2 * scale, name


def test_no_gradient_is_made_without_autograd(groups):
    """Evaluation (``torch.no_grad``): the trained tokens' per-token loss, untrained ones' 0,
    no gradient made."""
    plain, chunked = _pair(groups, 5, False, ROWS)
    hidden, labels, mask = _batch(ROWS)
    with torch.no_grad():
        expected = _forward(plain, hidden, labels, megatron=True)
        found = _forward(chunked, hidden, labels)
    torch.testing.assert_close(found, expected * mask, rtol=1e-6, atol=1e-6)
    assert found.grad_fn is None


def test_a_micro_batch_without_trained_tokens(groups):
    """A micro-batch whose labels are all untrained (a context-parallel rank's share of
    prompt): loss 0 and gradients of 0, the weight's made (a gradient the reduction waits
    for), as megatron-core's path gives."""
    plain, chunked = _pair(groups, 0, False, ROWS)
    hidden, labels, _ = _batch(ROWS)
    labels[:] = -100
    mask = torch.zeros_like(labels, dtype=torch.float32)
    loss, hidden_grad, grads = _step(plain, hidden, labels, mask, megatron=True)
    found_loss, found_hidden_grad, found_grads = _step(chunked, hidden, labels, mask)
    assert not found_loss.any() and not found_hidden_grad.any()
    assert found_grads.keys() == grads.keys()
    assert not found_grads["output_layer.weight"].any()


def test_the_host_count_of_trained_tokens_is_taken_once(groups):
    """The trainer's forward step hands the loss the micro-batch's labels on the host
    (``HostLabels``): the same loss from their count (no device read), taken once; a count
    the labels do not hold, fewer or more, is refused (an assertion that on a GPU the host does
    not wait for), not answered with other rows."""
    plain, chunked = _pair(groups, 0, False, ROWS)
    hidden, labels, mask = _batch(ROWS)
    expected = _forward(plain, hidden, labels, megatron=True) * mask
    chunked.host_labels.labels = labels.clone()
    torch.testing.assert_close(_forward(chunked, hidden, labels), expected, rtol=1e-6,
                               atol=1e-6)
    assert chunked.host_labels.labels is None
    wrong = labels.clone()
    wrong[0, 5] = -100                  # one trained token fewer than the device's labels
    chunked.host_labels.labels = wrong
    with pytest.raises(RuntimeError, match="told 19 trained tokens, its labels hold another"):
        _forward(chunked, hidden, labels)
    wrong = labels.clone()
    wrong[wrong == -100] = 3            # every token trained: more than the device's labels
    chunked.host_labels.labels = wrong
    with pytest.raises(RuntimeError, match=f"told {wrong.numel()} trained tokens, its labels"):
        _forward(chunked, hidden, labels)


def test_the_output_layer_runs_on_the_trained_rows_alone(groups):
    """torch's FLOP counter over the forward and backward passes: megatron-core's path makes
    all 24 tokens' logits, mimo's the 20 trained ones' (the output layer's three matmuls,
    2 · h · V FLOPs a token each); everything else the same."""
    from torch.utils.flop_counter import FlopCounterMode
    plain, chunked = _pair(groups, 0, False, ROWS)
    batch = _batch(ROWS)
    counted = []
    for model, megatron in ((plain, True), (chunked, False)):
        with FlopCounterMode(display=False) as counter:
            _step(model, *batch, megatron=megatron)
        counted.append(counter.get_total_flops())
    untrained = int((batch[1] == -100).sum())
    assert untrained == 4
    assert counted[0] - counted[1] == 3 * 2 * HIDDEN * ROWS * untrained


def test_a_loss_weighing_tokens_otherwise_is_refused_on_the_cpu(groups):
    """The chunked gradient is that of a scalar times the trained tokens' summed loss (what
    ``loss_func`` takes): summing the untrained tokens' losses too is refused, not answered
    wrongly."""
    _, chunked = _pair(groups, 5, False, ROWS)
    hidden, labels, _ = _batch(ROWS)
    loss = chunked(input_ids=None, position_ids=torch.arange(TOKENS).expand(BATCH, -1),
                   attention_mask=None, decoder_input=hidden.requires_grad_(), labels=labels)
    with pytest.raises(RuntimeError, match="weighs tokens otherwise"):
        loss.sum().backward()
    # a scalar times the mask is the gradient of the same loss, scaled
    loss = chunked(input_ids=None, position_ids=torch.arange(TOKENS).expand(BATCH, -1),
                   attention_mask=None, decoder_input=hidden, labels=labels)
    (loss * (labels != -100) * 3.0).sum().backward()
