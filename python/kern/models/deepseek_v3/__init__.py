"""DeepSeek-V3/R1 and Kimi K2's text model: multi-head latent attention over latent pages,
group-routed experts with shared experts, and multi-token-prediction layers a target drafts
with. ``config`` and ``tensors`` (torch-free), ``model``, ``mtp`` (the MTP layer as a model),
``tiny``; the registry row is in ``kern.models.registry``."""
