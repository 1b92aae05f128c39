"""``tools/gpu/bench.py graphs``: the decode step's CUDA graphs (kern.engine.cuda_graphs) on the
device, against eager; apart from bench.py for its length."""

from __future__ import annotations

import torch
from common import MODELS, SMALL, _load, _runner, timed


def section_graphs(args) -> dict:
    """Decode through CUDA graphs (kern.engine.cuda_graphs) against eager on the ~0.6B: a
    real row's logits bits padded up to each size against the eager unpadded step, and
    ms/step both ways. --small: the CPU's padded eager stand-in (bits only mean the padding)."""
    from kern.chunk import SeqChunk
    from kern.engine.cuda_graphs import DecodeGraphs, capture_sizes
    from kern.engine.params import SamplingParams
    from kern.engine.sampler import sample
    from kern.tiny import make_tiny

    name, sizes = next(iter(SMALL.items())) if args.small else ("qwen3-0.6b", MODELS["qwen3-0.6b"])
    path = args.work / name
    if not (path / "config.json").is_file():
        make_tiny("qwen3", path, seed=0, overwrite=True, dtype="bfloat16", shards=4, **sizes)
    ckpt = _load(path, args.small)
    most, prompt, steps, page = (8, 16, 4, 16) if args.small else (64, 128, 32, 16)
    runner, tables = _runner(ckpt, most + 1, prompt + steps + 1, page)
    scratch = tables.pop()[0]  # the last sequence's first page: the padding rows' own
    mode = "padded" if args.small else "graph"
    graphs = DecodeGraphs(runner, capture_sizes(most), scratch, prompt + steps + 1, mode=mode)
    seconds = graphs.capture()
    print(f"- {name}: captured batch {list(graphs.sizes)} in {seconds:.1f} s ({mode})")
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, ckpt.config.vocab_size, (most, prompt), generator=gen).tolist()
    chunks = [
        SeqChunk(p, 0, t, slot=i) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
    ]
    first = sample(runner.forward(chunks), [SamplingParams()] * most, [0] * most)
    out: dict = {"capture_s": seconds, "bits": {}, "rows": []}
    held = True
    for n in sorted({1, 3, *graphs.sizes}):
        if n > most:
            continue
        batch = [SeqChunk([first[i]], prompt, tables[i], slot=i) for i in range(n)]
        want = runner.forward_eager(batch)
        got = graphs.run(batch)
        same = got is not None and torch.equal(got, want)
        out["bits"][n] = same
        held &= same
    print(
        f"- a real row's logits bits, graph (padded) against eager (unpadded): "
        f"{'held' if held else 'CHANGED'} at {sorted(out['bits'])} rows"
    )
    print()
    print("| model | batch | eager ms/step | graph ms/step | speed-up |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for b in (1, 2) if args.small else (1, 8, 64):
        greedy = [SamplingParams()] * b

        def run(b=b, greedy=greedy, use=None) -> None:
            runner.graphs = use
            tokens, pos = first[:b], prompt
            for s in range(steps):
                batch = [SeqChunk([tokens[i]], pos, tables[i], slot=i) for i in range(b)]
                tokens = sample(runner.forward(batch), greedy, [s + 1] * b)
                pos += 1
            runner.graphs = None

        eager = timed(run, repeat=3, warmup=1) / steps * 1e3
        graph = timed(lambda run=run: run(use=graphs), repeat=3, warmup=1) / steps * 1e3
        out["rows"].append((name, b, eager, graph))
        print(f"| {name} | {b} | {eager:.2f} | {graph:.2f} | {eager / graph:.1f}x |", flush=True)
    if not held:
        raise SystemExit("graphs: a real row's bits changed under padding (see the list)")
    return out
