"""The model: ``build`` makes megatron-core's ``MimoModel`` from the resolved config; ``parts``
says where each module sits in it and what its weights are called in the whole model."""
