import pytest
import torch
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen3_rope
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb as qwen3_5_rope

from kern.kernels.rotary import reference, rotary


@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "head_dim", "rotary_dim", "dtype"),
    [
        pytest.param(1, 4, 64, 64, torch.float32, id="T1-H4-D64-R64-fp32"),
        pytest.param(7, 3, 128, 32, torch.float32, id="T7-H3-D128-R32-fp32"),
        pytest.param(63, 2, 256, 64, torch.bfloat16, id="T63-H2-D256-R64-bf16"),
        pytest.param(130, 1, 80, 80, torch.float16, id="T130-H1-D80-R80-fp16"),
    ],
)
def test_rotary_kernel(num_tokens, num_heads, head_dim, rotary_dim, dtype, assert_close, tol):
    x = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,))
    ref = reference.apply_rotary(x, positions, 1e6, rotary_dim)
    got = rotary.apply_rotary(x, positions, 1e6, rotary_dim)
    assert got.dtype == dtype
    assert_close("y", ref, got, tol(dtype))
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])


def test_rotary_kernel_strided_input(assert_close, tol):
    """q sliced out of a fused projection: token stride larger than H * D."""
    fused = torch.randn(9, 4 * 64 + 2 * 64).view(9, 6, 64)
    q = fused[:, :4]
    positions = torch.arange(9) + 100
    ref = reference.apply_rotary(q, positions, 1e4, 64)
    assert_close("q", ref, rotary.apply_rotary(q, positions, 1e4, 64), tol(torch.float32))


def test_reference_matches_qwen3_5():
    """Bitwise, float32: partial rotary (factor 0.25), mrope sections all at the text position."""
    config = Qwen3_5TextConfig(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    rope = Qwen3_5TextRotaryEmbedding(config)
    positions = torch.arange(11) + 37
    q = torch.randn(1, 2, 11, 64)
    cos, sin = rope(q, positions[None, None].expand(3, 1, -1))
    want, _ = qwen3_5_rope(q, q, cos, sin)
    got = reference.apply_rotary(q[0].transpose(0, 1), positions, 1e7, 16)
    assert torch.equal(got, want[0].transpose(0, 1))


def test_reference_matches_qwen3():
    config = Qwen3Config(hidden_size=128, num_attention_heads=2, head_dim=64, rope_theta=1e6)
    rope = Qwen3RotaryEmbedding(config)
    positions = torch.arange(11) + 5
    q = torch.randn(1, 2, 11, 64)
    cos, sin = rope(q, positions[None])
    want, _ = qwen3_rope(q, q, cos, sin)
    got = reference.apply_rotary(q[0].transpose(0, 1), positions, 1e6, 64)
    assert torch.equal(got, want[0].transpose(0, 1))


@pytest.mark.parametrize("rotary_dim", [16, 64])
def test_reference_row_invariant(rotary_dim):
    x = torch.randn(40, 2, 80)
    positions = torch.randint(0, 10000, (40,))
    want = reference.apply_rotary(x[7:8], positions[7:8], 1e6, rotary_dim)[0]
    for num_rows in (2, 3, 5, 16, 40):
        rows = torch.randperm(40)[:num_rows]
        rows[-1] = 7
        got = reference.apply_rotary(x[rows], positions[rows], 1e6, rotary_dim)[-1]
        assert torch.equal(got, want), num_rows
