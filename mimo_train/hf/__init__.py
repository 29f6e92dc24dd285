"""Back to transformers: ``export`` writes a checkpoint as transformers models, ``generate``
runs an export (``mimo-export``, ``mimo-generate``); ``processor_files`` writes the
tokenizer, processor and generation files beside the weights, ``adapters`` PEFT's files.
"""
