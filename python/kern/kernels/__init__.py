"""Triton kernels, each beside its torch reference.

One package per op: ``kern.kernels.<op>.reference`` imports only torch (the CPU runner
calls it directly), ``kern.kernels.<op>.<op>`` holds the Triton kernel and a wrapper with the
same signature. ``kern.kernels.pointwise`` runs elementwise transcendentals batch invariantly
on the CPU. Nothing here imports triton, so the references work without it.
"""
