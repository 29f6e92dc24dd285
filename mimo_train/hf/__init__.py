"""Back to transformers: ``export`` writes a checkpoint as transformers models, ``generate``
runs an export (``mimo-export``, ``mimo-generate``).
"""
