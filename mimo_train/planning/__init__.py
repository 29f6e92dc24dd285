"""What a run costs before and while it runs: the model's dims (``dims``), its training FLOPs
(``flops``), its memory (``memory``), the layout advisor (``advisor``) and what would lower a
rank's memory when it runs out (``memory_remedies``); no megatron-core import, no process
group."""
