"""DeepSeek-V4: shared-KV attention over a sliding window plus compressed entries, hyper-
connections, hash-routed first layers. ``config`` and ``tensors`` (torch-free), ``model``,
``attention`` (its attention's parts in torch ops), ``pages`` (its page kind: compressed
pages), ``tiny``; the registry row is in ``kern.models.registry``."""
