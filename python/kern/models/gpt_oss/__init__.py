"""gpt-oss (``gpt_oss``): attention with sinks and alternating sliding windows, YaRN RoPE, and
routed experts with biases and a clamped SwiGLU, bf16 or MXFP4. ``config`` (its config.json
and tensors, torch-free), ``model``, ``tiny``; the registry row is in ``kern.models.registry``."""
