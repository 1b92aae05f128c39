"""``tools/gpu/bench.py decode``: make-tiny qwen3 models in bf16 through kern's runner on the
device, eager and through CUDA graphs, at batch 1, 8 and 64, beside the device's measured read
bandwidth and its datasheet peak; apart from bench.py for its length.

A step's bytes are every weight it reads once (the embedding table only when the LM head is
tied to it) and each sequence's K/V at mid-decode; "of measured" is the time those bytes take
at the measured read bandwidth over the step's time, "of peak" the same at the datasheet's.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from common import MODELS, SMALL, _load, _runner, device, read_bandwidth, spec_read_bandwidth, timed

# Other servers' figures to read the table beside (their sources named; not measured here).
ANCHORS = (
    "vLLM, Qwen3-0.6B, one H100, light load: 2.39 ms a step (ovg-project/kvcached PR #331, "
    "H100_results.md)",
    "vLLM, Llama-3.1-8B, one H100, concurrency 1: 6.48 ms a step, about 74% of the HBM "
    "roofline (quoted when this work was planned; its source was not re-read here)",
)
HF_MAX_PARAMS = 2e9  # transformers' generate is timed on the models below this only


def section_decode(args) -> dict:
    from kern.tiny import make_tiny

    models = SMALL if args.small else {m: MODELS[m] for m in args.models}
    bw = read_bandwidth(args.small)
    name, peak = spec_read_bandwidth()
    peak_s = f"{peak / 1e12:.2f} TB/s by its datasheet" if peak else "no datasheet figure here"
    print(f"- device: {name}; read bandwidth measured {bw / 1e12:.2f} TB/s; {peak_s}")
    for anchor in ANCHORS:
        print(f"- anchor: {anchor}")
    batches = (1, 2) if args.small else (1, 8, 64)
    prompt, steps = (16, 4) if args.small else (128, 32)
    prefill_len = 64 if args.small else 2048
    out: dict = {"read_bytes_per_s": bw, "spec_bytes_per_s": peak, "device": name, "rows": []}
    print()
    print(
        "| model | batch | eager ms/step | graphs ms/step | tok/s | MB a step "
        "| of measured bandwidth | of peak | HF generate b1 tok/s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model, sizes in models.items():
        path = args.work / model
        if not (path / "config.json").is_file():
            t = time.perf_counter()
            make_tiny("qwen3", path, seed=0, overwrite=True, dtype="bfloat16", shards=4, **sizes)
            print(f"<!-- made {model} in {time.perf_counter() - t:.0f} s -->", flush=True)
        rows = _decode_model(model, path, sizes, batches, prompt, steps, (bw, peak), args.small)
        out["rows"] += rows
        out.setdefault("prefill", {})[model] = _prefill(path, prefill_len, args.small)
    return out


def _decode_model(name, path, sizes, batches, prompt, steps, bws, small) -> list:
    from kern.chunk import SeqChunk
    from kern.engine.cuda_graphs import DecodeGraphs
    from kern.engine.params import SamplingParams
    from kern.engine.sampler import sample

    bw, peak = bws
    ckpt = _load(path, small)
    weight_bytes, params = _weight_bytes(ckpt)
    kv_per_token = 2 * sizes["layers"] * sizes["kv_heads"] * sizes["head_dim"] * 2
    hf = _hf_generate(path, prompt, steps, small) if params < HF_MAX_PARAMS else None
    rows = []
    gen = torch.Generator().manual_seed(0)
    max_len = prompt + steps + 1
    for b in batches:
        # one sequence more than the batch: its first page is the graphs' padding rows' own
        runner, tables = _runner(ckpt, b + 1, max_len, 16)
        scratch = tables.pop()[0]
        prompts = torch.randint(0, ckpt.config.vocab_size, (b, prompt), generator=gen).tolist()
        greedy = [SamplingParams()] * b
        pairs = enumerate(zip(prompts, tables, strict=True))
        chunks = [SeqChunk(p, 0, t, slot=i) for i, (p, t) in pairs]
        first = sample(runner.forward(chunks), greedy, [0] * b)

        def run(first=first, b=b, tables=tables, runner=runner, greedy=greedy) -> None:
            tokens, pos = first, prompt
            for s in range(steps):
                batch = [SeqChunk([tokens[i]], pos, tables[i], slot=i) for i in range(b)]
                tokens = sample(runner.forward(batch), greedy, [s + 1] * b)
                pos += 1

        eager = timed(run, repeat=3, warmup=1) / steps
        graphs_s = None
        try:
            mode = "padded" if small else "graph"
            runner.graphs = DecodeGraphs(runner, (b,), scratch, max_len, mode=mode)
            runner.graphs.capture()
            graphs_s = timed(run, repeat=3, warmup=1) / steps
        except Exception as e:  # a capture that fails is a figure too: named, not fatal
            print(f"<!-- {name} batch {b}: graphs failed: {type(e).__name__}: {e} -->")
        finally:
            runner.graphs = None
        best = min(eager, graphs_s or eager)
        # bytes one step reads: every weight once, and each sequence's KV at mid-decode
        step_bytes = weight_bytes + b * (prompt + steps // 2) * kv_per_token
        of_bw = step_bytes / bw / best
        of_peak = f"{step_bytes / peak / best:.0%}" if peak else ""
        graph_ms = f"{graphs_s * 1e3:.2f}" if graphs_s else "failed"
        hf_s = f"{hf:,.0f}" if b == 1 and hf else ""
        rows.append(
            dict(
                model=name,
                batch=b,
                eager_ms=eager * 1e3,
                graphs_ms=graphs_s * 1e3 if graphs_s else None,
                tok_s=b / best,
                step_bytes=step_bytes,
                of_measured=of_bw,
                of_peak=step_bytes / peak / best if peak else None,
                hf_tok_s=hf if b == 1 else None,
            )
        )
        print(
            f"| {name} | {b} | {eager * 1e3:.2f} | {graph_ms} | {b / best:,.0f} "
            f"| {step_bytes / 1e6:,.1f} | {of_bw:.0%} | {of_peak} | {hf_s} |",
            flush=True,
        )
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def _weight_bytes(ckpt) -> tuple[int, int]:
    """Bytes of the weights one decode step reads in bf16 (all of them, except the embedding
    table when the LM head is a separate tensor: a step reads a few of its rows), and the
    model's parameter count."""
    total = params = 0
    tied = "lm_head.weight" not in ckpt.tensors
    for key, t in ckpt.tensors.items():
        params += t.numel()
        if key == "model.embed_tokens.weight" and not tied:
            continue
        total += t.numel() * 2
    return total, params


def _hf_generate(path: Path, prompt: int, steps: int, small: bool) -> float | None:
    """transformers' batch-1 greedy generate on the same weights, decoded tokens/s."""
    try:
        import transformers
    except ImportError:
        print("<!-- transformers is not installed: no generate figure -->")
        return None
    dtype = torch.float32 if small else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device())
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device=device())
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def gen(n: int):
        return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)

    with torch.inference_mode():
        full = timed(gen(steps + 1), repeat=2, warmup=1)
        one = timed(gen(1), repeat=2, warmup=1)
    return steps / max(full - one, 1e-9)


def _prefill(path: Path, tokens: int, small: bool) -> float:
    from kern.chunk import SeqChunk

    ckpt = _load(path, small)
    runner, tables = _runner(ckpt, 1, tokens + 1, 16)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, ckpt.config.vocab_size, (tokens,), generator=gen).tolist()
    seconds = timed(lambda: runner.forward([SeqChunk(prompt, 0, tables[0], slot=0)]), repeat=3)
    print(f"- {path.name}: prefill of one {tokens}-token prompt: {tokens / seconds:,.0f} tok/s")
    return tokens / seconds
