"""Torch reference for the gated delta rule of Qwen3.5's gated DeltaNet layers.

Ragged and slot addressed: sequence b owns rows query_start_loc[b]:query_start_loc[b+1]
and recurrent state states[slot_ids[b]] ([H, Dk, Dv], float32), read as the initial state
and overwritten with the final one. The maths is transformers' `torch_chunk_gated_delta_rule`
and `torch_recurrent_gated_delta_rule` (same op order), per sequence.

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
    """float32 copies, heads first: q, k [H, L, Dk], v [H, L, Dv], g, beta [H, L]."""
    q, k, v, g, beta = (x.transpose(0, 1).float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = l2norm(q)
        k = l2norm(k)
    return q, k, v, g, beta


def _check(q: Tensor, v: Tensor, g: Tensor, states: Tensor) -> None:
    if states.dtype != torch.float32:
        raise TypeError(f"states must be float32, got {states.dtype}")
    if g.shape != q.shape[:2] or states.shape[1:] != (q.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"states {tuple(states.shape)} (want g [T, H], states [S, H, Dk, Dv])"
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

    q, k: [T, H, Dk]; v: [T, H, Dv]; g (log decay, <= 0), beta: [T, H]; states:
    [S, H, Dk, Dv] float32, mutated in place at slot_ids[b] for each sequence b (a sequence
    with no rows leaves its slot untouched); slot_ids: [B] int64; query_start_loc: [B+1].
    H is the number of value heads: repeat q/k heads first when num_k_heads < num_v_heads
    (value head h uses key head h // (Hv // Hk)). Per token, with S [Dk, Dv] per head:
        S = S * exp(g_t);  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t)
    Returns [T, H, Dv] in q.dtype.
    """
    _check(q, v, g, states)
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
            state = state * gs[:, i].exp()[:, None, None]
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
    `torch_chunk_gated_delta_rule` run on one sequence and one chunk at a time.
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
            gs, bs = (F.pad(x, (0, c - n)) for x in (gs, bs))
            qs = qs * scale
            v_beta = vs * bs[..., None]
            k_beta = ks * bs[..., None]
            cum = gs.cumsum(dim=-1)  # [H, C] log of the decay from the chunk start
            decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(upper, float("-inf")).exp()
            ut_system = (k_beta @ ks.transpose(-1, -2)) * decay
            attn = (qs @ ks.transpose(-1, -2)) * decay
            decayed_k_beta = k_beta * cum.exp()[..., None]
            # The diagonal of ut_system is read as 1 (unitriangular), as in transformers.
            new_values = torch.linalg.solve_triangular(
                ut_system, v_beta, upper=False, unitriangular=True
            )
            k_cumdecay = torch.linalg.solve_triangular(
                ut_system, decayed_k_beta, upper=False, unitriangular=True
            )
            q_dec = qs * cum.exp()[..., None]
            k_dec = ks * (cum[:, -1:] - cum).exp()[..., None]
            chunk_decay = cum[:, -1].exp()[:, None, None]
            v_new = new_values - k_cumdecay @ state
            o = q_dec @ state + attn @ v_new  # [H, C, Dv]
            state = state * chunk_decay + k_dec.transpose(-1, -2) @ v_new
            out[c0:c1] = o[:, :n].transpose(0, 1)
        assert state.shape == (num_heads, k_dim, v_dim)
        states[slot] = state
    return out.to(q.dtype)
