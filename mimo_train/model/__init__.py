"""The model: ``build`` makes megatron-core's ``MimoModel`` from the resolved config; ``parts``
says where each module sits in it and what its weights are called in the whole model;
``tower_attention`` and ``tower_fusions`` are what ``build`` puts in transformers' towers (the
varlen attention, the fused elementwise regions)."""
