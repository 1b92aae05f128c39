"""Qwen3.5-MoE (text; Qwen3.6's MoE releases too): Qwen3.5's hybrid of gated DeltaNet and
gated full attention with routed experts and a gated shared expert on every layer. ``config``
(its config.json and tensors, torch-free), ``model``, ``tiny``; the registry row is in
``kern.models.registry``."""
