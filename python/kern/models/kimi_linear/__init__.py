"""Kimi-Linear: Kimi Delta Attention in most layers, NoPE latent attention in the rest, and
DeepSeek-style routed experts. ``config`` and ``tensors`` (torch-free), ``model``, ``tiny``;
the registry row is in ``kern.models.registry``."""
