"""Qwen3-MoE: Qwen3's attention with routed experts on the sparse layers. ``config`` (its
config.json and tensors, torch-free), ``model``, ``tiny``; the registry row is in
``kern.models.registry``."""
