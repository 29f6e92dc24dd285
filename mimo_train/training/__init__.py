"""The trainer: set-up in phases and the loop (``trainer``), and what one step runs through
megatron-core's schedules (``step``).
"""
