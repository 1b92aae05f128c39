"""Qwen3 (dense): ``config`` (its config.json and tensors, torch-free), ``model`` (the
forward), ``tiny`` (the tiny checkpoint's config). Its registry row is in
``kern.models.registry``."""
