"""Training components, each usable alone: distributed checkpoints (``checkpoint``) and their
integrity manifests (``digests``), the optimizer and its LR schedules (``optimizer``), step
records and logging (``metrics``), non-finite steps and loss spikes (``anomalies``).
"""
