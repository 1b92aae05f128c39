"""Qwen3-Next: Qwen3.5's hybrid of gated DeltaNet and gated full attention, with routed
experts and a gated shared expert. ``config`` (its config.json and tensors, torch-free),
``model``, ``tiny``; the registry row is in ``kern.models.registry``."""
