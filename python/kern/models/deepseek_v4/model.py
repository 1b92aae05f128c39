"""DeepSeek-V4: shared-KV attention over a sliding window plus compressed entries (CSA with a
lightning indexer, HCA), manifold-constrained hyper-connections, hash-routed first layers.

Matches transformers 5.23 ``DeepseekV4ForCausalLM`` (tensor names as its ``save_pretrained``
writes them, DeepSeek's under ``model.``):

* The residual is ``hc_mult`` streams. Around each block a hyper-connection (``hc_attn_*``,
  ``hc_ffn_*``) takes the streams' unweighted RMS norm through one linear to ``pre``
  (sigmoid + eps), ``post`` (2 sigmoid) and ``comb`` (softmax + eps, then Sinkhorn: one
  column pass, then ``hc_sinkhorn_iters - 1`` row and column passes, eps ``hc_eps``), all in
  float32. The block reads sum_j pre_j x_j; the streams become
  ``post_k * out + sum_j comb[j, k] x_j``. ``hc_head`` collapses them before ``model.norm``.
* Attention (``attn.``): ``q = wq_b(q_norm(wq_a(x)))`` per head, RMS-normalised without a
  weight; one shared entry ``norm(wkv(x))`` is key and value. RoPE turns the trailing
  ``qk_rope_head_dim`` dims in interleaved pairs (sliding layers: ``rope_theta``; compressed
  layers: ``compress_rope_theta``, YaRN-scaled as configured) and turns the output back
  (``-sin``). Softmax over the window's ``sliding_window`` entries and the layer's compressed
  ones, with one sink logit per head; ``scale = head_dim ** -0.5``. Output: per group of
  heads ``wo_a`` (grouped, ``o_groups``), then ``wo_b``.
* Compressors (``attn.compressor.``): per window of ``m`` tokens a softmax pooling over the
  tokens of ``wkv(x)`` weighted by ``wgate(x) + ape[offset]``, RMS-normalised (``norm``),
  RoPE at the window's first position. CSA (m = compress_rates[0]) pools twice as wide: a
  token's first half joins the next window's entry, its second half its own window's; the
  indexer (``attn.indexer.``) pools keys of ``index_head_dim`` the same way and scores them
  ``sum_h weights_proj(x)_h / sqrt(H_i) * relu(q_h . k) / sqrt(index_head_dim)`` with
  ``q = wq_b(q_norm(wq_a(x)))`` (RoPE'd); a query attends to its top ``index_topk``
  visible entries. HCA (m = compress_rates[1]) attends to every visible entry. An entry is
  visible to position p when its window ended at or before p.
* MoE (``ffn.``): router scores ``sqrtsoftplus`` (or ``sigmoid``) of ``gate.weight``; hash
  layers take the experts ``gate.tid2eid[token]``, the others the top-k of scores +
  ``gate.bias``; weights the chosen scores over their sum (+1e-20) times
  ``routed_scaling_factor``. Experts and shared experts are SwiGLU with the gate clamped
  above and the up projection clamped both ways at ``swiglu_limit``.

Design notes
------------
* Memory: ``kern.models.deepseek_v4.pages`` (everything in pages, hits at every page end);
  the attention parts: ``kern.models.deepseek_v4.attention``.
* Projections that read the same input are one matmul split by columns (wq_a, wkv, the
  compressors' wkv and wgate, the indexer's compressor and weights_proj).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kern.backend import Ops
from kern.batch import Step
from kern.models.config import ModelConfig
from kern.models.deepseek_v4 import attention as ca
from kern.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Fields
from kern.models.layers.caches import Caches, Tensors, param
from kern.models.layers.moe import SparseMoE
from kern.models.layers.rope import scaled_frequencies


def _inv_freq(theta: float, dim: int) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def _sum(parts: list[Tensor]) -> Tensor:
    """Left to right: a fixed order whatever the batch."""
    out = parts[0]
    for x in parts[1:]:
        out = out + x
    return out


def _softmax(x: Tensor) -> Tensor:
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


class HyperConnection:
    """The pre / post / comb weights of one block's hyper-connection (see the module notes)."""

    def __init__(self, ops: Ops, c: ModelConfig, fn: Tensor, base: Tensor, scale: Tensor) -> None:
        v4: DeepseekV4Fields = c.family_fields
        self.ops = ops
        self.n = v4.hc_mult
        self.iters = v4.hc_sinkhorn_iters
        self.eps = v4.hc_eps
        self.norm_eps = c.rms_norm_eps
        # float32 whatever the backend computes in (transformers keeps mHC in float32): the
        # CPU's batch-invariant linear is float32 already, other backends take F.linear.
        self.w_fn = ops.prepare_linear(fn.float()) if ops.is_cpu else fn.float().to(ops.device)
        self.base = base.float().to(ops.device)
        self.scale = scale.float().to(ops.device)

    @classmethod
    def named(cls, ops: Ops, c: ModelConfig, t: Tensors, prefix: str) -> HyperConnection:
        """A block's, from ``<prefix>_fn``, ``_base`` and ``_scale``."""
        return cls(ops, c, t[f"{prefix}_fn"], t[f"{prefix}_base"], t[f"{prefix}_scale"])

    def collapse(self, streams: Tensor) -> Tensor:
        """``hc_head``: the streams weighted by sigmoid(mix * scale + base) + eps, summed."""
        pre = self.ops.sigmoid(self.mix(streams) * self.scale + self.base) + self.eps
        return _sum([pre[:, j, None] * streams[:, j] for j in range(self.n)]).to(streams.dtype)

    def mix(self, streams: Tensor) -> Tensor:
        flat = streams.reshape(streams.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        if self.ops.is_cpu:
            return self.ops.linear(flat, self.w_fn)
        return torch.nn.functional.linear(flat, self.w_fn)

    def __call__(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """streams [T, n, hidden] -> (post [T, n], comb [T, n, n], the block's input)."""
        n, ops = self.n, self.ops
        mixes = self.mix(streams)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = ops.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * ops.sigmoid(post_w * self.scale[1] + post_b)
        comb = _softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n)) + self.eps
        # Sums over n <= 16 values per row: torch's reduction takes them in one fixed order
        # whatever the number of rows (the invariance test's batches hold it).
        comb = comb / (comb.sum(1, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(2, keepdim=True) + self.eps)
            comb = comb / (comb.sum(1, keepdim=True) + self.eps)
        x = _sum([pre[:, j, None] * streams[:, j] for j in range(n)]).to(streams.dtype)
        return post, comb, x

    @staticmethod
    def merge(post: Tensor, comb: Tensor, out: Tensor, streams: Tensor) -> Tensor:
        """``post_k * out + sum_j comb[j, k] streams_j`` -> [T, n, hidden]."""
        dtype = streams.dtype
        comb = comb.to(dtype)
        mixed = _sum([comb[:, j, :, None] * streams[:, j, None, :] for j in range(comb.shape[1])])
        return post.to(dtype)[:, :, None] * out[:, None, :] + mixed


class Compressor:
    """One compressor's weights (``wkv``, ``wgate``, ``ape``, ``norm``); its projections run
    in the attention's fused first matmul."""

    def __init__(self, ops: Ops, t: Tensors, prefix: str, rate: int, eps: float) -> None:
        self.rate = rate
        self.eps = eps
        self.w = torch.cat([t[f"{prefix}wkv.weight"], t[f"{prefix}wgate.weight"]])
        self.width = t[f"{prefix}wkv.weight"].shape[0]
        # CSA's compressors pool two series (Ca | Cb) of the normalised width each.
        self.pair = self.width != t[f"{prefix}norm.weight"].shape[0]
        self.ape = t[f"{prefix}ape"].float().to(ops.device)
        self.norm = ops.prepare_norm(t[f"{prefix}norm.weight"].float())

    def __call__(self, ops: Ops, p, both: Tensor, state: Tensor, rope) -> Tensor:
        """Pool the step's rows; the normalised, rotated entries they close."""
        kv, gate = both[:, : self.width], both[:, self.width :]
        gate = gate.float() + self.ape[(p.positions % self.rate)]
        pooled = ca.pool(ops, p, self.rate, kv, gate, state, pair=self.pair)
        entries = ops.rms_norm(pooled, self.norm, self.eps)
        cos, sin = p.rope_at(1, rope, self.rate)  # compressed layers use the second set
        return ca.rope(entries, cos, sin)


class Attention:
    """One layer's attention (see the module notes)."""

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str, index: int) -> None:
        v4: DeepseekV4Fields = c.family_fields
        self.ops = ops
        self.index = index
        self.kind = v4.attention_types[index]
        self.h, self.d = c.num_attention_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim**-0.5
        self.groups = v4.o_groups
        first = [t[f"{prefix}wq_a.weight"], t[f"{prefix}wkv.weight"]]
        self.split = [first[0].shape[0], first[1].shape[0]]
        self.compressor = self.indexer = None
        csa, hca = v4.compress_rates
        if self.kind != SLIDING:
            rate = csa if self.kind == CSA else hca
            self.compressor = Compressor(ops, t, f"{prefix}compressor.", rate, self.eps)
            first.append(self.compressor.w)
            self.split.append(self.compressor.w.shape[0])
        if self.kind == CSA:
            self.indexer = Compressor(ops, t, f"{prefix}indexer.compressor.", csa, self.eps)
            first += [self.indexer.w, t[f"{prefix}indexer.weights_proj.weight"]]
            self.split += [self.indexer.w.shape[0], v4.index_n_heads]
            self.w_iq = ops.prepare_linear(t[f"{prefix}indexer.wq_b.weight"])
            self.hi, self.di = v4.index_n_heads, v4.index_head_dim
            self.topk = v4.index_topk
        self.w_first = ops.prepare_linear(torch.cat(first))
        self.q_norm = ops.prepare_norm(t[f"{prefix}q_norm.weight"])
        self.kv_norm = ops.prepare_norm(t[f"{prefix}norm.weight"])
        self.w_qb = ops.prepare_linear(t[f"{prefix}wq_b.weight"])
        self.ones = ops.prepare_norm(torch.ones(c.head_dim))  # q's norm has no weight
        wo_a = t[f"{prefix}wo_a.weight"]
        self.w_oa = [ops.prepare_linear(w) for w in wo_a.chunk(v4.o_groups)]
        self.w_ob = ops.prepare_linear(t[f"{prefix}wo_b.weight"])
        self.sinks = t[f"{prefix}attn_sink"].float().to(ops.device)

    def __call__(self, x: Tensor, step: Step, caches: Caches) -> Tensor:
        ops, p = self.ops, step.attention
        assert isinstance(p, ca.CompressedPlan)
        views = caches.kv[self.index]  # kern.models.deepseek_v4.pages.LayerViews
        which = 0 if self.kind == SLIDING else 1
        rope = step.rope[which]
        n, h, d = x.shape[0], self.h, self.d
        parts = ops.linear(x, self.w_first).split(self.split, dim=1)
        q_res = ops.rms_norm(parts[0], self.q_norm, self.eps)
        q = ops.linear(q_res, self.w_qb).view(n, h, d)
        cos, sin = p.rope_at(which, rope)
        q = ca.rope(ops.rms_norm(q, self.ones, self.eps), cos, sin)
        kv = ca.rope(ops.rms_norm(parts[1], self.kv_norm, self.eps), cos, sin)
        views.window[p.row_window, p.row_offset] = kv.to(views.window.dtype)
        pages = slots = extra_valid = None
        if self.compressor is not None:
            assert views.entries is not None and views.state is not None
            m = self.compressor.rate
            entries = self.compressor(ops, p, parts[2], views.state, rope)
            ca.write_entries(p, m, entries, views.entries)
            if self.indexer is None:
                rp = p.rates[m]
                pages, slots, extra_valid = rp.visible_pages, rp.visible_slots, rp.visible
            else:
                assert views.keys is not None and views.index_state is not None
                keys = self.indexer(ops, p, parts[3], views.index_state, rope)
                ca.write_entries(p, m, keys, views.keys)
                iq = ops.linear(q_res, self.w_iq).view(n, self.hi, self.di)
                iq = ca.rope(iq, cos, sin)
                weights = parts[4].float() * self.hi**-0.5
                pages, slots, extra_valid = ca.index_topk(
                    ops, p, m, iq, weights, views.keys, self.topk, self.di**-0.5
                )
        if ops.is_cpu:
            extra = None if pages is None else views.entries[pages, slots]
            o = ca.attend(p, q, views.window, extra, extra_valid, self.sinks, self.scale)
        else:
            table, rows, valid = ca.key_rows(
                p, views.window, views.entries, pages, slots, extra_valid
            )
            o = ops.sparse_attention(q, table, rows, valid, self.sinks, self.scale)
        o = ca.rope(o, cos, -sin).reshape(n, self.groups, -1)
        o = torch.cat([ops.linear(o[:, g], w) for g, w in enumerate(self.w_oa)], dim=1)
        return ops.linear(o, self.w_ob)


class ClampedMLP:
    """SwiGLU whose gate is clamped above and up both ways at ``limit`` (0: unclamped)."""

    def __init__(self, ops: Ops, t: Tensors, prefix: str, limit: float) -> None:
        self.ops = ops
        self.limit = limit
        self.w_gate_up = ops.prepare_linear(
            torch.cat([t[f"{prefix}w1.weight"], t[f"{prefix}w3.weight"]])
        )
        self.w_down = ops.prepare_linear(t[f"{prefix}w2.weight"])

    def __call__(self, x: Tensor) -> Tensor:
        return self.ops.linear(
            clamped_swiglu(self.ops, self.ops.linear(x, self.w_gate_up), self.limit), self.w_down
        )


def clamped_swiglu(ops: Ops, gate_up: Tensor, limit: float) -> Tensor:
    if limit:
        inter = gate_up.shape[-1] // 2
        gate_up = torch.cat(
            [gate_up[:, :inter].clamp(max=limit), gate_up[:, inter:].clamp(-limit, limit)], 1
        )
    return ops.silu_and_mul(gate_up)


class MoE(SparseMoE):
    """V4's routed experts (hash or score routing) plus the shared experts."""

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str, hashed: bool) -> None:
        v4: DeepseekV4Fields = c.family_fields
        assert c.experts is not None
        names = {}
        for e in range(c.experts.num_experts):
            for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                name = f"{prefix}experts.{e}.{theirs}.weight"
                if name in t:
                    names[f"{prefix}experts.{e}.{ours}.weight"] = t[name]
        super().__init__(
            ops, c, {**names, f"{prefix}gate.weight": t[f"{prefix}gate.weight"]}, prefix
        )
        limit = v4.swiglu_limit
        self.act = lambda x: clamped_swiglu(ops, x, limit)
        self.scoring = v4.scoring_func
        self.scaling = v4.routed_scaling_factor
        self.hashed = hashed
        if hashed:
            self.tid2eid = t[f"{prefix}gate.tid2eid"].long().to(ops.device)
        else:
            self.bias = t[f"{prefix}gate.bias"].float().to(ops.device)
        self.shared = ClampedMLP(ops, t, f"{prefix}shared_experts.", limit)

    def route(self, x: Tensor, token_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Each token's routing weights (x's dtype) and expert ids, [T, k] each (a hash
        layer's from ``token_ids``)."""
        ops = self.ops
        logits = ops.linear(x, self.w_router).float()
        if self.scoring == "sqrtsoftplus":
            scores = torch.sqrt(ops.softplus(logits))
        else:
            scores = ops.sigmoid(logits)
        if self.hashed:
            assert token_ids is not None, "a hash-routed layer routes by token ids"
            experts = self.tid2eid[token_ids]
        else:
            experts = torch.topk(scores + self.bias, self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        weights = weights / (_sum(list(weights.unbind(1)))[:, None] + 1e-20)
        return (weights * self.scaling).to(x.dtype), experts

    def __call__(self, x: Tensor, token_ids: Tensor) -> Tensor:  # type: ignore[override]
        weights, experts = self.route(x, token_ids)
        return self.combine(self.expert_outputs(x, experts), weights) + self.shared(x)


class Block:
    """One decoder layer: attention and MoE, each inside its hyper-connection."""

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, i: int) -> None:
        p = f"model.layers.{i}."
        self.ops = ops
        self.eps = c.rms_norm_eps
        self.attn_hc = HyperConnection.named(ops, c, t, p + "hc_attn")
        self.ffn_hc = HyperConnection.named(ops, c, t, p + "hc_ffn")
        self.attn_norm = ops.prepare_norm(t[p + "attn_norm.weight"])
        self.ffn_norm = ops.prepare_norm(t[p + "ffn_norm.weight"])
        self.attn = Attention(ops, c, t, p + "attn.", i)
        self.mlp = MoE(ops, c, t, p + "ffn.", c.family_fields.moe_types[i] == "hash_moe")

    def __call__(self, streams: Tensor, step: Step, caches: Caches) -> Tensor:
        ops = self.ops
        post, comb, x = self.attn_hc(streams)
        out = self.attn(ops.rms_norm(x, self.attn_norm, self.eps), step, caches)
        streams = HyperConnection.merge(post, comb, out, streams)
        post, comb, x = self.ffn_hc(streams)
        out = self.mlp(ops.rms_norm(x, self.ffn_norm, self.eps), step.token_ids)
        return HyperConnection.merge(post, comb, out, streams)


class DeepseekV4:
    """Embedding, blocks over hyper-connection streams, ``hc_head``, final norm and head."""

    stateful = False
    num_attention_layers = 0
    num_linear_layers = 0

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors) -> None:
        v4: DeepseekV4Fields = c.family_fields
        self.ops = ops
        self.config = c
        self.embed = param(ops, t["model.embed_tokens.weight"])
        self.final_norm = ops.prepare_norm(t["model.norm.weight"])
        tied = c.tie_word_embeddings
        self.w_head = ops.prepare_linear(t["model.embed_tokens.weight" if tied else "head.weight"])
        hc = "model.hc_head.hc_"
        self.head_hc = HyperConnection(ops, c, t[hc + "fn"], t[hc + "base"], t[hc + "scale"])
        self.layers = [Block(ops, c, t, i) for i in range(c.num_hidden_layers)]
        self.hc_mult = v4.hc_mult
        rd = v4.rope_head_dim
        main = (_inv_freq(c.rope_theta, rd), 1.0)
        theta = v4.compress_rope_theta
        inv, scale = scaled_frequencies(
            theta, c.rotary_dim, v4.compress_rope_type, v4.compress_rope_yarn
        )
        compress = (inv if inv is not None else _inv_freq(theta, rd), scale)
        self.ropes = (main, compress)

    def plan_rope(self, step: Step) -> object:
        """The two RoPE sets' frequencies; the attention's plan turns them into tables."""
        return self.ropes

    def forward(self, step: Step, caches: Caches) -> Tensor:
        """Hidden states [T, hidden] after ``hc_head`` (before the final norm); a tapped
        layer's output is its ``hc_mult`` streams, [T, hc_mult, hidden]."""
        x = self.embed[step.token_ids]
        streams = x[:, None, :].expand(-1, self.hc_mult, -1).contiguous()
        taps = caches.taps
        for i, layer in enumerate(self.layers):
            streams = layer(streams, step, caches)
            if i in taps:
                taps[i] = streams
        return self.head_hc.collapse(streams)

    def final_hidden(self, hidden: Tensor) -> Tensor:
        return self.ops.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.ops.linear(self.final_hidden(hidden), self.w_head).float()
