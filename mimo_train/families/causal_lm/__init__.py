"""The language families: a transformers causal LM (Llama, Qwen2, Qwen3, Qwen3-MoE), or the
language model of a whole VLM (``registry.read_vlm``: Qwen2-VL … Qwen3-VL-MoE, Qwen3.5 and
Qwen3.5-MoE), as megatron-core's local-spec ``GPTModel``.

- ``architecture``: ``read_architecture(path)`` reads the checkpoint's ``config.json`` into a
  ``LanguageArch`` (dims, rotary base, scaling and share, RMSNorm eps and zero-centring, tied
  embeddings, qkv bias, qk-norm, experts, Qwen3.5's layer kinds and gates), refusing what
  megatron-core's local layers cannot reproduce; ``transformer_fields`` / ``gpt_fields`` turn
  it into ``TransformerConfig`` and ``GPTModel`` arguments;
- ``weights``: ``to_megatron`` converts the transformers weights into one TP/PP rank's part of
  the megatron state dict, ``to_hf`` merges TP parts back (for export),
  ``load_pretrained_language`` loads a rank's part into a built ``GPTModel``;
- ``delta_net``: Qwen3.5's gated delta-net layers' weights;
- ``parts``: a TP rank's parts of the checkpoint's tensors, read as the converters cut them
  (safetensors slices, the dtype stored), the experts a rank holds alone.

Name mapping (layer ``N`` global in transformers, local to the pipeline stage in megatron):

| transformers ``model.…`` | megatron-core | TP split |
|---|---|---|
| ``embed_tokens.weight`` | ``embedding.word_embeddings.weight`` | rows (vocab) |
| ``layers.N.input_layernorm.weight`` | ``decoder.layers.N.input_layernorm.weight`` | none |
| ``layers.N.self_attn.{q,k,v}_proj.{weight,bias}`` | ``….self_attention.linear_qkv.…`` | rows |
| ``layers.N.self_attn.{q,k}_norm.weight`` (Qwen3, 3.5) | ``….{q,k}_layernorm.weight`` | none |
| ``layers.N.self_attn.o_proj.weight`` | ``….self_attention.linear_proj.weight`` | columns |
| ``layers.N.post_attention_layernorm.weight`` | ``….pre_mlp_layernorm.weight`` | none |
| ``layers.N.mlp.{gate,up}_proj.weight`` | ``….mlp.linear_fc1.weight`` | rows, per half |
| ``layers.N.mlp.down_proj.weight`` | ``….mlp.linear_fc2.weight`` | columns |
| ``norm.weight`` | ``decoder.final_layernorm.weight`` | none |
| ``lm_head.weight`` (or the embedding, tied) | ``output_layer.weight`` | rows (vocab) |
| ``layers.N.mlp.gate.weight`` (MoE) | ``….mlp.router.weight`` | none |
| ``….mlp.experts.{gate_up,down}_proj`` | ``….experts.local_experts.E.linear_fc{1,2}…`` | as MLP |
| ``….mlp.shared_expert.*`` (Qwen3.5-MoE) | ``….mlp.shared_experts.linear_fc{1,2}…`` | as MLP |
| ``….mlp.shared_expert_gate.weight`` | ``….mlp.shared_experts.gate_weight`` | none |
| ``layers.N.linear_attn.*`` (Qwen3.5) | ``….self_attention.*`` (GatedDeltaNet) | ``delta_net`` |

Qwen3.5 besides: its attention's ``q_proj`` holds each head's query and then its output gate
(``attention_output_gate``: megatron-core's ``linear_qkv`` takes, per group, the query heads,
then their gate heads, then the key and value heads); its norms are ``1 + weight``
(``layernorm_zero_centered_gamma``: the same stored weights), but for the delta-net's gated
norm; its rotary embedding turns a quarter of each head (``rotary_percent``); its
multi-token-prediction layers (``mtp.*``) are not built: ``mimo-export`` writes them back from
the checkpoint as they were.

A whole VLM holds the same names under one of the prefixes its family module gives
(``VLM.language_prefixes``: ``model.language_model.`` in transformers 4.52+'s layout, the
family's original one otherwise): whichever the checkpoint has is ``LanguageArch.prefix``, and
its output layer's name ``LanguageArch.head``; a Qwen VL text config's ``mrope_section`` is
``LanguageArch.mrope_section``.

``linear_qkv`` holds, per query group, that group's query heads, then its key head, then its
value head (``[ng, (nh/ng + 2) · d, hidden]``): the layout ``SelfAttention`` splits; TP ranks
take whole groups. ``linear_fc1`` is ``[gate; up]`` (megatron's SwiGLU chunks the output in
two), so TP rank r holds ``[gate_r; up_r]``.

Vocabulary: megatron's vocabulary is the tokenizer's (modality tokens included) or the
checkpoint's, whichever is larger, padded (``plan.language.Vocabulary``; the padding rows are
masked out of every softmax). Every row past the
checkpoint's vocabulary, in the embedding and the output layer, starts as the mean of the
checkpoint's rows (transformers' ``resize_token_embeddings`` starts new rows at that mean too):
a new token's input is an average token and its logit an average logit, so adding tokens does
not shift the pretrained model's predictions. No random draw is involved.

Why a module of its own: mbridge (which has these name tables) builds TransformerEngine specs
only (fused names such as ``linear_qkv.layer_norm_weight``) and its model builder no longer runs
with megatron-core 0.19.2; Megatron-Bridge brings a very large dependency set. Neither drives
the local-spec layers mimo uses on CPU. This package imports no megatron-core.
"""


from mimo_train.families.causal_lm.architecture import (FAMILIES, HYBRID, LINEAR, MIXTURES,
                                                        LanguageArch, LinearAttention,
                                                        gpt_fields, read_architecture,
                                                        transformer_fields)
from mimo_train.families.causal_lm.weights import (adapters_to_hf, load_pretrained_language,
                                                   to_hf, to_megatron)

__all__ = ["FAMILIES", "HYBRID", "LINEAR", "MIXTURES", "LanguageArch", "LinearAttention",
           "adapters_to_hf", "gpt_fields", "load_pretrained_language",
           "read_architecture", "to_hf", "to_megatron", "transformer_fields"]
