"""Layers the Qwen families share: full attention over paged KV, the SwiGLU MLP, and the
decoder stack around them (embedding, residual blocks, final norm, LM head).

A model is plain tensors and functions of (step, caches): no ``nn.Module``, no autograd, no
per-call state. Weights are prepared once by the backend (``ops.prepare_linear``: reordered
for the CPU's batch-invariant matmul) and projections that read the same input are fused into
one matmul (q/k/v; gate/up), which splits its output columns exactly as separate matmuls would
be laid out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kern.backend import Ops
from kern.batch import Step
from kern.model_config import ModelConfig

Tensors = dict[str, Tensor]


class Caches:
    """Per-layer views the layers read and write: KV ([P, 2, page_tokens, Hk, D]) for each
    full-attention layer, conv and
    delta-rule states for each linear-attention layer, and where to put row snapshots."""

    def __init__(
        self,
        kv: list[Tensor],
        conv: list[Tensor],
        delta: list[Tensor],
        conv_snap: list[Tensor] | None = None,
        delta_snap: list[Tensor] | None = None,
    ) -> None:
        self.kv = kv
        self.conv = conv
        self.delta = delta
        self.conv_snap = conv_snap
        self.delta_snap = delta_snap


class Attention:
    """Causal GQA attention with per-head q/k RMSNorm and RoPE (Qwen3); with ``gated``, the
    Qwen3.5 variant: q_proj also emits a per-head gate, the output is scaled by sigmoid(gate),
    and only the first ``rotary_dim`` dims of each head rotate."""

    def __init__(
        self,
        ops: Ops,
        c: ModelConfig,
        t: Tensors,
        prefix: str,
        kv_index: int,
        *,
        gated: bool,
        norm_offset: float,
    ) -> None:
        self.ops = ops
        self.kv_index = kv_index
        self.gated = gated
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.rotary_dim = c.rotary_dim
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim**-0.5
        names = ("q_proj", "k_proj", "v_proj")
        self.w_qkv = ops.prepare_linear(torch.cat([t[f"{prefix}{n}.weight"] for n in names]))
        self.b_qkv = None
        self.b_o = None
        if c.attention_bias:
            self.b_qkv = _param(ops, torch.cat([t[f"{prefix}{n}.bias"] for n in names]))
            self.b_o = _param(ops, t[f"{prefix}o_proj.bias"])
        self.w_o = ops.prepare_linear(t[f"{prefix}o_proj.weight"])
        # q and k heads are normalised and rotated as one [T, Hq + Hk, D] tensor: one set of
        # ops instead of two, and the same bits (both are per-head, per-element).
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk_norm = torch.cat(
            [
                t[f"{prefix}q_norm.weight"].expand(h, d),
                t[f"{prefix}k_norm.weight"].expand(hk, d),
            ]
        )
        self.qk_norm = ops.prepare_norm(qk_norm, norm_offset)

    def __call__(self, x: Tensor, step: Step, caches: Caches) -> Tensor:
        ops = self.ops
        n = x.shape[0]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = ops.linear(x, self.w_qkv, self.b_qkv)
        gate = None
        if self.gated:
            # Per head: head_dim queries, then head_dim gate logits (transformers' chunk).
            q_gate = qkv[:, : 2 * h * d].reshape(n, h, 2 * d)
            gate = q_gate[:, :, d:].reshape(n, h * d)
            kv = qkv[:, 2 * h * d :].reshape(n, 2 * hk, d)
            qk = torch.cat([q_gate[:, :, :d], kv[:, :hk]], dim=1)
            v = kv[:, hk:]
        else:
            heads = qkv.view(n, h + 2 * hk, d)
            qk, v = heads[:, : h + hk], heads[:, h + hk :]
        qk = ops.rotary(ops.rms_norm(qk, self.qk_norm, self.eps), step.rope, self.rotary_dim)
        q, k = qk[:, :h], qk[:, h:]
        kv_cache = caches.kv[self.kv_index]
        ops.write_kv(step, k, v, kv_cache)
        o = ops.attention(step, q, kv_cache, self.scale).reshape(n, h * d)
        if gate is not None:
            o = o * ops.sigmoid(gate)
        return ops.linear(o, self.w_o, self.b_o)


class DenseMLP:
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, ops: Ops, t: Tensors, prefix: str) -> None:
        self.ops = ops
        gate_up = torch.cat([t[f"{prefix}gate_proj.weight"], t[f"{prefix}up_proj.weight"]])
        self.w_gate_up = ops.prepare_linear(gate_up)
        self.w_down = ops.prepare_linear(t[f"{prefix}down_proj.weight"])

    def __call__(self, x: Tensor) -> Tensor:
        ops = self.ops
        return ops.linear(ops.silu_and_mul(ops.linear(x, self.w_gate_up)), self.w_down)


class DecoderLayer:
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self,
        ops: Ops,
        c: ModelConfig,
        t: Tensors,
        prefix: str,
        mixer: Callable[[Tensor, Step, Caches], Tensor],
        mlp: Callable[[Tensor], Tensor],
        norm_offset: float,
    ) -> None:
        self.ops = ops
        self.eps = c.rms_norm_eps
        self.input_norm = ops.prepare_norm(t[f"{prefix}input_layernorm.weight"], norm_offset)
        self.post_norm = ops.prepare_norm(
            t[f"{prefix}post_attention_layernorm.weight"], norm_offset
        )
        self.mixer = mixer
        self.mlp = mlp

    def __call__(self, x: Tensor, step: Step, caches: Caches) -> Tensor:
        ops = self.ops
        x = x + self.mixer(ops.rms_norm(x, self.input_norm, self.eps), step, caches)
        return x + self.mlp(ops.rms_norm(x, self.post_norm, self.eps))


class DecoderModel:
    """Embedding, decoder layers, final norm and LM head of a ``*ForCausalLM``.

    ``norm_offset`` is what every RMSNorm of the stack adds to its weight (0 for Qwen3, 1 for
    Qwen3.5's zero-centred norms). Subclasses build ``self.layers``.
    """

    stateful = False

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, norm_offset: float) -> None:
        self.ops = ops
        self.config = c
        self.norm_offset = norm_offset
        self.embed = _param(ops, t["model.embed_tokens.weight"])
        self.final_norm = ops.prepare_norm(t["model.norm.weight"], norm_offset)
        head = t["model.embed_tokens.weight"] if c.tie_word_embeddings else t["lm_head.weight"]
        self.w_head = ops.prepare_linear(head)
        self.layers: list[DecoderLayer] = []
        self.num_attention_layers = sum(
            not c.is_linear_layer(i) for i in range(c.num_hidden_layers)
        )
        self.num_linear_layers = c.num_hidden_layers - self.num_attention_layers

    def forward(self, step: Step, caches: Caches) -> Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm)."""
        x = self.embed[step.token_ids]
        for layer in self.layers:
            x = layer(x, step, caches)
        return x

    def logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] rows -> [N, vocab] float32 logits."""
        ops = self.ops
        x = ops.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return ops.linear(x, self.w_head).float()


def _param(ops: Ops, t: Tensor) -> Tensor:
    return t.to(device=ops.device, dtype=ops.dtype).contiguous()
