"""Layers several families share, one concept a module: ``caches`` (what layers read and write
besides weights), ``attention`` (GQA over paged K/V), ``mlp`` (SwiGLU), ``decoder`` (the
stack: embedding, residual blocks, final norm, head), ``moe`` (routed experts), ``mla``
(multi-head latent attention), ``rope`` (RoPE frequencies, YaRN)."""
