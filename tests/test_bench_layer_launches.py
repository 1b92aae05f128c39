"""``kern.bench.layer_launches``: a qwen3 layer's decode launches on the CUDA wiring (Triton
under the interpreter), held to what the fused kernels brought them to: the q/k norm, RoPE and
the KV write one launch, the residual adds fused into the norms that follow them, SiLU-and-mul
into the gate_up linear, no host sync."""

from __future__ import annotations

from collections import Counter

import pytest


def test_a_qwen3_layer_at_decode(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from kern.bench.layer_launches import count

    ops, launches, layers = count("qwen3", 3)
    kernels: Counter = Counter()
    for (layer, name), n in launches.items():
        if layer is not None:
            kernels[name] += n
    # the KV write is in qk_norm_rope_kernel, SiLU-and-mul in the gate_up linear's
    assert kernels == Counter(
        linear_kernel=3 * layers,
        linear_silu_and_mul_kernel=layers,
        paged_attention_kernel=layers,
        qk_norm_rope_kernel=layers,
        rms_norm_kernel=2 * layers,
    )
    compute: Counter = Counter()
    for (layer, kind), n in ops.items():
        if layer is not None and kind.startswith("op "):
            compute[kind] += n
    # The MLP's residual add goes into the next layer's input norm (the last one's, once a
    # step, outside the layers).
    assert compute == Counter()
    assert not any(k == "sync" for _, k in ops)
