"""mimo_train: heterogeneous-parallel MIMO training on megatron-core (see docs/architecture.md)."""
