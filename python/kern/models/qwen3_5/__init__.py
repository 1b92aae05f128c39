"""Qwen3.5 (text): gated DeltaNet linear attention interleaved with gated full attention.
``config`` (its config.json and tensors, torch-free), ``model``, ``tiny``; the registry row is
in ``kern.models.registry``."""
