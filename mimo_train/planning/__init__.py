"""What a run costs before and while it runs: the model's dims (``dims``), its training FLOPs
(``flops``); no megatron-core import, no process group."""
