"""Model families: one module per family of transformers models mimo builds from or reads, and
the registry that resolves a checkpoint to them.

- ``base``: what every family shares: the encoder contract and its checks, the projection,
  a checkpoint's weights read by name, ``VLM`` (what mimo takes from a whole vision-language
  checkpoint) and ``model_directory`` (a directory or a cached hub name).
- ``causal_lm``: Llama, Qwen2 and Qwen3 decoders (alone, or a whole VLM's language model) as
  megatron-core's ``GPTModel``; weights in (``to_megatron``) and out (``to_hf``).
- encoder families, each an ``Encoder`` class (built from a modality config and dims, a
  pretrained directory or a whole ``VLM``; weights read in fp32, one row per placeholder
  token): ``qwen2_vl``, ``qwen2_5_vl``, ``siglip``, ``whisper``, ``llava`` (a LLaVA's tower).
  A whole-VLM family module also has ``read(config, path) -> VLM`` (which encoder kind takes its
  tower, which projection its projector is, where each part's weights sit, how its images are
  written) and ``image_geometry(config, processor)`` (its image processor's settings as a
  preprocessing config).
- ``registry``: the families by kind and ``model_type``, ``read_vlm`` / ``language_arch``
  (a checkpoint to what mimo takes from it, or the reason it cannot), ``build_encoder``,
  ``preprocessing_for`` (``mimo_train.plan.resolve`` reads a training config's checkpoints
  through them).

Family modules import ``base`` only, never the registry: the registry imports them.
A new family is one module here, registered in ``registry``, plus its tests. Families that
cannot be taken are refused with the reason (``registry.REFUSED``), never approximated.
"""
