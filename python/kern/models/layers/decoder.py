"""The decoder stack the families share: embedding, pre-norm residual blocks, final norm and
LM head of a ``*ForCausalLM``, and the step's RoPE."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from kern.backend import Ops
from kern.batch import Step
from kern.models.config import ModelConfig
from kern.models.layers.caches import Caches, Tensors, param
from kern.models.layers.rope import rope_frequencies

__all__ = ["DecoderLayer", "DecoderModel"]


class DecoderLayer:
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x)).

    The MLP's residual add is left to the next layer (:meth:`run`): its input norm adds it
    in the same kernel (``ops.add_rms_norm``), one launch a layer fewer. The sum is the same
    tensor either way (the add is computed, then normalised), so the bits do not change."""

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
        x, h = self.run(x, None, step, caches)
        return x + h

    def run(
        self, x: Tensor, pending: Tensor | None, step: Step, caches: Caches
    ) -> tuple[Tensor, Tensor]:
        """The block on ``x + pending`` (the previous layer's MLP output not yet added; None:
        nothing pending) -> (x, h): the block's output is ``x + h``."""
        ops = self.ops
        if pending is None:
            y = ops.rms_norm(x, self.input_norm, self.eps)
        else:
            x, y = ops.add_rms_norm(x, pending, self.input_norm, self.eps)
        h = self.mixer(y, step, caches)
        x, y = ops.add_rms_norm(x, h, self.post_norm, self.eps)
        return x, self.mlp(y)


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
        self.embed = param(ops, t["model.embed_tokens.weight"])
        self.final_norm = ops.prepare_norm(t["model.norm.weight"], norm_offset)
        head = t["model.embed_tokens.weight"] if c.tie_word_embeddings else t["lm_head.weight"]
        self.w_head = ops.prepare_linear(head)
        self.layers: list[DecoderLayer] = []
        self.num_attention_layers = sum(
            not c.is_linear_layer(i) for i in range(c.num_hidden_layers)
        )
        self.num_linear_layers = c.num_hidden_layers - self.num_attention_layers
        self.rope = rope_frequencies(c)

    def plan_rope(self, step: Step) -> object:
        """The step's RoPE tables, built once for every layer (the backend's plan)."""
        c = self.config
        return self.ops.plan_rope(step.positions, c.rope_theta, c.rotary_dim, *self.rope)

    def forward(self, step: Step, caches: Caches) -> Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm); the
        outputs of the layers ``caches.taps`` names are put there."""
        x = self.embed[step.token_ids]
        h = None  # the last layer's MLP output, added by the next one (DecoderLayer.run)
        taps = caches.taps
        for i, layer in enumerate(self.layers):
            x, h = layer.run(x, h, step, caches)
            if i in taps:
                taps[i] = x + h
        return x if h is None else x + h

    def final_hidden(self, hidden: Tensor) -> Tensor:
        """[N, hidden] rows after the final norm (what the LM head reads)."""
        return self.ops.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)

    def logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] rows -> [N, vocab] float32 logits."""
        return self.ops.linear(self.final_hidden(hidden), self.w_head).float()
