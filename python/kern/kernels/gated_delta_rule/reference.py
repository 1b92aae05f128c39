"""Torch reference for the gated delta rule: Qwen3.5's gated DeltaNet (a decay per head, g
[T, H]) and Kimi-Linear's Kimi Delta Attention (a decay per key channel, g [T, H, Dk]).

Ragged and slot addressed: sequence b owns rows query_start_loc[b]:query_start_loc[b+1]
and recurrent state states[slot_ids[b]] ([H, Dk, Dv], float32), read as the initial state
and overwritten with the final one. Per head, the maths is transformers'
`torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule` (same op order), per
sequence; per channel, the recurrent form is `recurrent_kimi_delta_attention`'s op order and
the chunked form `chunk_kimi_delta_attention`'s, with its decays taken as products of the
per-token factors exp(g_t) (see `_chunk_per_channel`).

Design notes (batch invariance, see README.md):
- Each sequence is computed alone, and each chunk alone with one fixed shape ([H, C, .],
  zero padded; padded tokens have g = 0, beta = 0, k = 0 and so change nothing), so a
  sequence's bits depend only on its own tokens and state, never on its batch.
- The recurrent form is token by token: any split of a sequence into calls gives the
  same bits. The chunked form gives the same bits for splits at multiples of chunk_size
  (counted from the state it starts from); a split elsewhere re-chunks and changes rounding.
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """transformers' (and fla's) l2norm: x * rsqrt(sum(x^2, -1) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, use_qk_l2norm: bool):
    """float32 copies, heads first: q, k [H, L, Dk], v [H, L, Dv], beta [H, L], g as given
    ([H, L] or [H, L, Dk])."""
    q, k, v, g, beta = (x.transpose(0, 1).float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = l2norm(q)
        k = l2norm(k)
    return q, k, v, g, beta


def _check(q: Tensor, v: Tensor, g: Tensor, states: Tensor) -> None:
    if states.dtype != torch.float32:
        raise TypeError(f"states must be float32, got {states.dtype}")
    g_ok = g.shape in (q.shape[:2], q.shape)
    if not g_ok or states.shape[1:] != (q.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"states {tuple(states.shape)} (want g [T, H] or [T, H, Dk], states "
            "[S, H, Dk, Dv])"
        )


def gated_delta_rule_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    slot_ids: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
) -> Tensor:
    """Token-by-token gated delta rule: the ground truth, and the decode step.

    q, k: [T, H, Dk]; v: [T, H, Dv]; g (log decay, <= 0): [T, H] per head or [T, H, Dk]
    per key channel; beta: [T, H]; states: [S, H, Dk, Dv] float32, mutated in place at
    slot_ids[b] for each sequence b (a sequence with no rows leaves its slot untouched);
    slot_ids: [B] int64; query_start_loc: [B+1]. H is the number of value heads: repeat q/k
    heads first when num_k_heads < num_v_heads (value head h uses key head h // (Hv // Hk)).
    Per token, with S [Dk, Dv] per head:
        S = exp(g_t) S  (per channel: row d of S times exp(g_t[d]))
        S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t)
    Returns [T, H, Dv] in q.dtype.
    """
    _check(q, v, g, states)
    # per head as one channel: [H, 1, 1] broadcasts the same products as [H] did
    g = g if g.dim() == 3 else g[..., None]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    starts = query_start_loc.tolist()
    for b, slot in enumerate(slot_ids.tolist()):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        qs, ks, vs, gs, bs = _prepare(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], use_qk_l2norm)
        qs = qs * scale
        state = states[slot].clone()  # [H, Dk, Dv]
        for i in range(e - s):
            q_t, k_t, v_t = qs[:, i], ks[:, i], vs[:, i]
            state = state * gs[:, i].exp()[:, :, None]
            kv_mem = (state * k_t[:, :, None]).sum(dim=-2)
            delta = (v_t - kv_mem) * bs[:, i, None]
            state = state + k_t[:, :, None] * delta[:, None, :]
            out[s + i] = (state * q_t[:, :, None]).sum(dim=-2)
        states[slot] = state
    return out.to(q.dtype)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    slot_ids: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> Tensor:
    """Chunked gated delta rule (prefill): same contract as `gated_delta_rule_recurrent`.

    Within a chunk of C tokens, the delta-rule updates are condensed by the UT transform
    (a unit lower triangular solve), then chunks are scanned in order; this is transformers'
    `torch_chunk_gated_delta_rule` (per head) or `chunk_kimi_delta_attention` (per channel)
    run on one sequence and one chunk at a time.
    """
    _check(q, v, g, states)
    num_heads, k_dim, v_dim = states.shape[1:]
    c = chunk_size
    dev = v.device
    out = torch.empty(v.shape, dtype=torch.float32, device=dev)
    # mask of what a causal chunk may not attend to: strictly upper triangle
    upper = torch.ones(c, c, dtype=torch.bool, device=dev).triu(1)
    starts = query_start_loc.tolist()
    for b, slot in enumerate(slot_ids.tolist()):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        state = states[slot].clone()  # [H, Dk, Dv]
        for c0 in range(s, e, c):
            c1 = min(c0 + c, e)
            n = c1 - c0
            qs, ks, vs, gs, bs = _prepare(
                q[c0:c1], k[c0:c1], v[c0:c1], g[c0:c1], beta[c0:c1], use_qk_l2norm
            )
            # One fixed shape per chunk: pad to C tokens (g = 0: no decay, beta = 0: no write).
            qs, ks, vs = (F.pad(x, (0, 0, 0, c - n)) for x in (qs, ks, vs))
            gs = F.pad(gs, (0, 0, 0, c - n) if gs.dim() == 3 else (0, c - n))
            bs = F.pad(bs, (0, c - n))
            qs = qs * scale
            v_beta = vs * bs[..., None]
            k_beta = ks * bs[..., None]
            decays = _decays_per_channel if gs.dim() == 3 else _decays_per_head
            ut_system, attn, from_start, to_end, whole = decays(gs, qs, ks, k_beta, upper)
            # The diagonal of ut_system is read as 1 (unitriangular), as in transformers.
            new_values = torch.linalg.solve_triangular(
                ut_system, v_beta, upper=False, unitriangular=True
            )
            k_cumdecay = torch.linalg.solve_triangular(
                ut_system, k_beta * from_start, upper=False, unitriangular=True
            )
            v_new = new_values - k_cumdecay @ state
            o = (qs * from_start) @ state + attn @ v_new  # [H, C, Dv]
            state = state * whole + (ks * to_end).transpose(-1, -2) @ v_new
            out[c0:c1] = o[:, :n].transpose(0, 1)
        assert state.shape == (num_heads, k_dim, v_dim)
        states[slot] = state
    return out.to(q.dtype)


def _decays_per_head(g: Tensor, q: Tensor, k: Tensor, k_beta: Tensor, upper: Tensor):
    """One chunk's decays with g [H, C] (transformers' op order): the UT system and the
    causal q.k scores, both decayed from column to row token, and the factors from the
    chunk start to each token, from each token to the chunk end, and over the whole chunk,
    shaped to broadcast over [H, C, Dk] ([H, Dk, Dv] for the last)."""
    cum = g.cumsum(dim=-1)  # [H, C] log of the decay from the chunk start
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay
    attn = (q @ k.transpose(-1, -2)) * decay
    from_start = cum.exp()[..., None]
    to_end = (cum[:, -1:] - cum).exp()[..., None]
    return ut_system, attn, from_start, to_end, cum[:, -1].exp()[:, None, None]


def _decays_per_channel(g: Tensor, q: Tensor, k: Tensor, k_beta: Tensor, upper: Tensor):
    """`_decays_per_head` with g [H, C, Dk]: the decay no longer factors out of the q.k and
    k.k products, so they are summed over channels with decay[h, i, j, d] applied.

    decay is the product of the per-token factors exp(g_t), t = j+1..i, each <= 1: KDA's
    gates reach -50 a token, where exp(-cumsum) overflows and a difference of cumulative
    sums far below -1000 is off by up to ~1e-4 (their float32 spacing); a product keeps
    float32's relative precision however small it gets (then 0), as the recurrent form does.
    """
    step = g.exp()  # [H, C, Dk]
    # row j, column t: exp(g_t) for t > j, else 1; the running product along t is decay
    factors = torch.where(upper[None, :, :, None], step[:, None], 1.0)
    decay = factors.cumprod(dim=2).transpose(1, 2).masked_fill(upper[..., None], 0.0)
    ut_system = (k_beta[:, :, None] * k[:, None] * decay).sum(dim=-1)  # [H, C, C]
    attn = (q[:, :, None] * k[:, None] * decay).sum(dim=-1)
    from_start = step.cumprod(dim=1)  # [H, C, Dk]
    return ut_system, attn, from_start, decay[:, -1], from_start[:, -1, :, None]
