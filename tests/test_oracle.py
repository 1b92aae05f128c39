"""kern's runner against transformers (the oracle) on tiny random checkpoints of every family.

Both sides run float32 on the CPU, transformers with eager attention. Greedy tokens must be
identical over 32 steps; logits must agree to within LOGIT_ATOL.

Tolerance: the two sides compute the same maths with different op orders (fused q/k/v and
gate/up matmuls, blocked attention, the token-by-token delta rule where transformers chunks
its prefill), so logits differ by float32 rounding compounded over the layers: 1e-6 to 5e-6
absolute was measured on these models, whose logits have a standard deviation near 1.
LOGIT_ATOL = 1e-4 leaves 20x headroom and is still far below the gap between the top two
logits that greedy decoding depends on.
"""

from __future__ import annotations

import pytest
import torch
from support.variants import build

from kern.checkpoint.load import load_checkpoint
from kern.chunk import SeqChunk
from kern.engine.generate import generate
from kern.engine.runner import Runner

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4
STEPS = 32
PAGE = 16

# (family, make_tiny options, config.json overrides)
CASES = {
    "qwen3-gqa4-d64-tied": (
        "qwen3",
        dict(heads=4, kv_heads=1, head_dim=64, tie_embeddings=True),
        {},
    ),
    "qwen3-mha-d128": ("qwen3", dict(layers=2, heads=2, kv_heads=2, head_dim=128), {}),
    "qwen3-default": ("qwen3", dict(layers=3), {}),
    "moe-e4-top2": ("qwen3_moe", dict(experts=4, experts_per_tok=2), {}),
    "moe-e8-top3-nonorm-step2": (
        "qwen3_moe",
        dict(layers=4, experts=8, experts_per_tok=3),
        dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3]),
    ),
    "qwen3_5-default": ("qwen3_5", dict(), {}),
    "deepseek_v3-q-lora": ("deepseek_v3", dict(), {}),
    # no q-LoRA, YaRN at 4x an original context of 64 (the prompt and decode run past it),
    # groups of 4 experts of which the best 2 count, 3 experts a token
    "deepseek_v3-no-q-lora-yarn": (
        "deepseek_v3",
        dict(
            q_lora_rank=0, yarn_factor=4.0, experts=16, n_group=4, topk_group=2, experts_per_tok=3
        ),
        {},
    ),
    "kimi_linear-default": ("kimi_linear", dict(), {}),
    # Kimi-Linear's own pattern (three KDA layers, then NoPE MLA), with a q-LoRA, a short conv
    # of 3, two groups of experts, every MLP sparse
    "kimi_linear-q-lora-k3": (
        "kimi_linear",
        dict(
            q_lora_rank=24,
            conv_kernel=3,
            linear_value_heads=2,
            linear_value_head_dim=32,
            full_attention_interval=4,
            n_group=2,
            topk_group=1,
            first_k_dense=0,
        ),
        {},
    ),
    # DeepSeek-V4 staged by layer type: the sliding window alone, then with HCA, then the
    # whole tiny schedule (sliding, CSA, HCA, CSA); windows of 8 and rates 4 / 8, so the
    # 41-token prompt closes entries in prefill and decode, with more CSA entries than top-k.
    "deepseek_v4-sliding": (
        "deepseek_v4",
        dict(),
        dict(layer_types=["sliding_attention"] * 4),
    ),
    "deepseek_v4-hca": (
        "deepseek_v4",
        dict(),
        dict(layer_types=["sliding_attention", "heavily_compressed_attention"] * 2),
    ),
    "deepseek_v4-default": ("deepseek_v4", dict(), {}),
    "deepseek_v4-tied": ("deepseek_v4", dict(tie_embeddings=True), {}),
    # The released Flash schedule's shape (two sliding layers, then CSA and HCA alternating,
    # three hash-routed layers first) with YaRN on the compressed layers' RoPE.
    "deepseek_v4-flash-shape-yarn": (
        "deepseek_v4",
        dict(layers=6, yarn_factor=4.0),
        dict(
            layer_types=["sliding_attention"] * 2
            + ["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
            mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3,
        ),
    ),
    # Qwen3-Next: the grouped in-projection with two value heads a key head, a gated shared
    # expert on the sparse layers; then unnormalised top-3 of 8, every other layer sparse and
    # the last one dense by mlp_only_layers.
    "qwen3_next-default": ("qwen3_next", dict(), {}),
    "qwen3_next-step2-nonorm": (
        "qwen3_next",
        dict(experts_per_tok=3, linear_value_heads=6),
        dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3]),
    ),
    "qwen3_5_moe-default": ("qwen3_5_moe", dict(), {}),
    # gpt-oss: windows of 8 on even layers, sinks, YaRN, biased router and experts; the
    # release's MXFP4 experts; a window of 3 on two layers in a row with no YaRN and a clamp
    # at 0.2 the activations reach.
    "gpt_oss-default": ("gpt_oss", dict(), {}),
    "gpt_oss-mxfp4": ("gpt_oss", dict(fp8=True), {}),
    "gpt_oss-w3-clamped": (
        "gpt_oss",
        dict(sliding_window=3, yarn_factor=0, experts=4, experts_per_tok=3, heads=8),
        dict(
            swiglu_limit=0.2,
            layer_types=["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
        ),
    ),
    "qwen3_5-d64-tied-k2v2": (
        "qwen3_5",
        dict(
            layers=3,
            head_dim=64,
            linear_key_heads=2,
            linear_value_heads=2,
            full_attention_interval=3,
            tie_embeddings=True,
        ),
        {},
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, options, overrides = CASES[request.param]
    path = build(tmp_path_factory.mktemp(request.param), family, options, overrides)
    ckpt = load_checkpoint(path)
    quantized = {}
    if ckpt.config.raw.get("quantization_config", {}).get("quant_method") == "mxfp4":
        quantized["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **quantized
    ).eval()
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, ckpt.config.vocab_size - 3, (41,), generator=gen).tolist()
    return ckpt, model, prompt


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy decode with its own cache: tokens and each step's logits."""
    out, logits = [], []
    with torch.no_grad():
        o = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            step_logits = o.logits[0, -1]
            token = int(step_logits.argmax())
            out.append(token)
            logits.append(step_logits)
            o = model(torch.tensor([[token]]), past_key_values=o.past_key_values, use_cache=True)
    return out, torch.stack(logits)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def runner_for(ckpt, num_pages: int = 32) -> Runner:
    return Runner.with_pages(ckpt, num_pages=num_pages, page_tokens=PAGE, num_slots=4)


def test_greedy_tokens_and_logits(case):
    ckpt, model, prompt = case
    ref_ids, ref_logits = hf_greedy(model, prompt, STEPS)
    vocab = ckpt.config.vocab_size
    result = generate(
        ckpt, prompt, STEPS, probe_steps=list(range(STEPS)), probe_k=vocab, page_tokens=PAGE
    )
    assert result.ids == ref_ids
    for s in range(STEPS):
        values, ids = result.probes[s]
        ours = torch.empty(vocab).scatter_(0, ids, values)
        torch.testing.assert_close(ours, ref_logits[s], atol=LOGIT_ATOL, rtol=0)


def test_prefill_in_one_go(case):
    ckpt, model, prompt = case
    runner = runner_for(ckpt)
    ours = runner.forward([SeqChunk(prompt, 0, list(range(8)), slot=0, logits="all")])
    torch.testing.assert_close(ours, hf_logits(model, prompt), atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize(
    "splits",
    [[1, 5, 16, 19], [7, 9, 25], [16, 16, 9], [40, 1]],
    ids=lambda s: "-".join(map(str, s)),
)
def test_chunked_prefill(case, splits):
    """Chunks that start mid-page and end mid-page, each reading the KV (and state) that
    earlier calls wrote."""
    ckpt, model, prompt = case
    assert sum(splits) == len(prompt)
    runner = runner_for(ckpt)
    table = [5, 2, 9, 0, 7]  # pages out of order: the block table is the only map
    pos, rows = 0, []
    for n in splits:
        rows.append(
            runner.forward([SeqChunk(prompt[pos : pos + n], pos, table, slot=1, logits="all")])
        )
        pos += n
    ref = hf_logits(model, prompt)
    torch.testing.assert_close(torch.cat(rows), ref, atol=LOGIT_ATOL, rtol=0)


def test_decode_after_cached_prefix(case):
    """A second sequence reuses the first one's prefix pages (the partial last page copied
    on write, the state snapshot copied to its own slot) and decodes from there."""
    ckpt, model, prompt = case
    runner = runner_for(ckpt)
    prefix = 21  # mid-page: pages 0-15 and 16-20
    runner.forward([SeqChunk(prompt[:prefix], 0, [3, 4], slot=0, logits="none")])
    runner.copy_pages([4], [6])
    runner.copy_slots([0], [2])
    table = [3, 6, 8]
    ours = runner.forward([SeqChunk(prompt[prefix:], prefix, table, slot=2, logits="all")])
    ref = hf_logits(model, prompt)
    torch.testing.assert_close(ours, ref[prefix:], atol=LOGIT_ATOL, rtol=0)
    # and decoding one token at a time on top of it matches transformers' greedy steps
    ref_ids, ref_logits = hf_greedy(model, prompt, 4)
    token, pos = int(ours[-1].argmax()), len(prompt)
    for s in range(4):
        assert token == ref_ids[s]
        logits = runner.forward([SeqChunk([token], pos, table, slot=2)])
        pos += 1
        if s + 1 < 4:
            torch.testing.assert_close(logits[0], ref_logits[s + 1], atol=LOGIT_ATOL, rtol=0)
        token = int(logits[0].argmax())
