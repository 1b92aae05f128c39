import pytest
import torch

from kern.kernels.qk_norm_rope import qk_norm_rope, reference
from kern.kernels.rms_norm import rms_norm as norm_kernel
from kern.kernels.rotary import rotary as rotary_kernel
from kern.kernels.rotary.reference import inv_freq

EPS = 1e-6


def _weight(num_q: int, num_k: int, head_dim: int) -> torch.Tensor:
    """q_norm's row on the q heads, k_norm's on the k heads (the attention layers' stack)."""
    q, k = torch.randn(head_dim) * 0.1, torch.randn(head_dim) * 0.1
    return torch.cat([q.expand(num_q, head_dim), k.expand(num_k, head_dim)])


@pytest.mark.parametrize(
    ("num_tokens", "num_q", "num_k", "head_dim", "rotary_dim", "offset", "dtype"),
    [
        pytest.param(1, 4, 2, 64, 64, 0.0, torch.float32, id="T1-qwen3-fp32"),
        pytest.param(7, 3, 1, 128, 32, 1.0, torch.float32, id="T7-partial-offset-fp32"),
        pytest.param(33, 2, 2, 128, 128, 0.0, torch.bfloat16, id="T33-bf16"),
        pytest.param(5, 4, 2, 96, 24, 1.0, torch.bfloat16, id="T5-D96-R24-bf16"),
    ],
)
def test_kernel_is_the_norm_then_the_rotary(
    num_tokens, num_q, num_k, head_dim, rotary_dim, offset, dtype, assert_close, tol
):
    """Against the reference within rounding, and bit for bit against the two unfused kernels
    in sequence (the norm per weight run, its output in x.dtype, then the rotary kernel)."""
    h = num_q + num_k
    x = torch.randn(num_tokens, h, head_dim).to(dtype)
    weight = _weight(num_q, num_k, head_dim)
    positions = torch.randint(0, 4096, (num_tokens,))
    freqs = inv_freq(1e6, rotary_dim)
    got = qk_norm_rope.qk_norm_rope(x, weight, EPS, offset, positions, 1e6, rotary_dim, freqs)
    ref = reference.qk_norm_rope(x, weight, EPS, offset, positions, 1e6, rotary_dim)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close("y", ref, got, tol(dtype))
    normed = torch.cat(
        [
            norm_kernel.rms_norm(x[:, :num_q].contiguous(), weight[0], EPS, offset=offset),
            norm_kernel.rms_norm(x[:, num_q:].contiguous(), weight[-1], EPS, offset=offset),
        ],
        dim=1,
    )
    unfused = rotary_kernel.apply_rotary(normed, positions, 1e6, rotary_dim, freqs=freqs)
    assert torch.equal(got, unfused)


def test_strided_input_from_the_fused_projection(assert_close, tol):
    """q and k heads sliced out of the qkv projection: a token stride past H * D."""
    qkv = torch.randn(6, (4 + 2 + 2) * 64).view(6, 8, 64)
    qk = qkv[:, :6]
    weight = _weight(4, 2, 64)
    positions = torch.arange(6) + 11
    got = qk_norm_rope.qk_norm_rope(qk, weight, EPS, 0.0, positions, 1e4, 64)
    ref = reference.qk_norm_rope(qk.contiguous(), weight, EPS, 0.0, positions, 1e4, 64)
    assert_close("qk", ref, got, tol(torch.float32))


def test_a_rows_bits_do_not_depend_on_the_batch():
    """Row 7's bits alone, and among 2 to 40 rows at any place in the batch."""
    x = torch.randn(40, 6, 128).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (40,))
    weight = _weight(4, 2, 128)

    def run(rows):
        return qk_norm_rope.qk_norm_rope(x[rows], weight, EPS, 1.0, positions[rows], 1e6, 64)

    want = run(torch.tensor([7]))[0]
    for num_rows in (2, 3, 5, 16, 40):
        rows = torch.randperm(40)[:num_rows]
        rows[num_rows // 2] = 7
        assert torch.equal(run(rows)[num_rows // 2], want), num_rows


def test_refusals():
    x = torch.randn(2, 3, 64)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        qk_norm_rope.qk_norm_rope(x, torch.ones(3, 64), EPS, 0.0, torch.arange(2), 1e4, 63)
    with pytest.raises(ValueError, match=r"weight must be \[3, 64\]"):
        qk_norm_rope.qk_norm_rope(x, torch.ones(64), EPS, 0.0, torch.arange(2), 1e4, 64)


@pytest.mark.parametrize(
    ("num_q", "num_k", "head_dim", "rotary_dim", "dtype"),
    [
        pytest.param(4, 2, 64, 64, torch.float32, id="qwen3-fp32"),
        pytest.param(3, 1, 96, 24, torch.bfloat16, id="partial-bf16"),
    ],
)
def test_the_kv_write_stores_what_write_kv_stores(num_q, num_k, head_dim, rotary_dim, dtype):
    """With kv: the same output, and the caches hold exactly what write_kv stores of its key
    heads and v (a strided arena like the runner's; other slots untouched)."""
    from kern.kernels.paged_attention import paged_attention

    t, page = 9, 4
    qkv = torch.randn(t, num_q + 2 * num_k, head_dim).to(dtype)
    qk, v = qkv[:, : num_q + num_k], qkv[:, num_q + num_k :]
    weight = _weight(num_q, num_k, head_dim)
    positions = torch.arange(t) + 5
    slots = torch.randperm(6 * page)[:t]
    arena = torch.full((6, 2, num_k, page, head_dim), -7.0, dtype=dtype)
    k_cache, v_cache = arena[:, 0].transpose(1, 2), arena[:, 1].transpose(1, 2)
    want_arena = arena.clone()
    want_k, want_v = want_arena[:, 0].transpose(1, 2), want_arena[:, 1].transpose(1, 2)
    args = (qk, weight, EPS, 1.0, positions, 1e6, rotary_dim)
    plain = qk_norm_rope.qk_norm_rope(*args)
    paged_attention.write_kv(plain[:, num_q:], v, want_k, want_v, slots)
    got = qk_norm_rope.qk_norm_rope(*args, kv=(v, k_cache, v_cache, slots))
    assert torch.equal(got, plain)
    assert torch.equal(arena, want_arena)
    ref_arena = torch.full_like(arena, -7.0)
    ref_k, ref_v = ref_arena[:, 0].transpose(1, 2), ref_arena[:, 1].transpose(1, 2)
    reference.qk_norm_rope(*args, kv=(v, ref_k, ref_v, slots))
    assert torch.equal(ref_arena != -7.0, arena != -7.0)
