"""``tools/gpu/bench.py sync``: one eager decode step of the ~0.6B qwen3 with its forward under
``torch.cuda.set_sync_debug_mode("error")`` (a host synchronisation there raises: what CUDA
graphs cannot capture), and the whole step's synchronisations counted under ``"warn"`` (the
step's inputs and plans, built on the host before the forward, may still take some). With
``--small`` on the CPU the forward runs under a dispatch mode that fails on a value read back
to the host or a tensor made from Python data instead (what would sync or copy on a GPU);
apart from bench.py for its length."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from common import MODELS, SMALL, _load, _runner, sync
from torch.utils._python_dispatch import TorchDispatchMode


class _HostReads(TorchDispatchMode):
    """Collects the ops that read a value back to the host (``.item()``, ``.tolist()``) or make
    a tensor from Python data: on a GPU a synchronisation and a host-to-device copy."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "_local_scalar_dense" in name or "lift_fresh" in name:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def _sync_mode(mode: str):
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def section_sync(args) -> dict:
    from kern.chunk import SeqChunk
    from kern.tiny import make_tiny

    name, sizes = next(iter(SMALL.items())) if args.small else ("qwen3-0.6b", MODELS["qwen3-0.6b"])
    path = args.work / name
    if not (path / "config.json").is_file():
        make_tiny("qwen3", path, seed=0, overwrite=True, dtype="bfloat16", shards=4, **sizes)
    ckpt = _load(path, args.small)
    batch_size, prompt = 3, 16
    runner, tables = _runner(ckpt, batch_size, prompt + 2, 16)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, ckpt.config.vocab_size, (batch_size, prompt), generator=gen)
    pairs = enumerate(zip(prompts.tolist(), tables, strict=True))
    runner.forward([SeqChunk(p, 0, t, slot=i) for i, (p, t) in pairs])
    sync()
    batch = [SeqChunk([7 + i], prompt, tables[i], slot=i) for i in range(batch_size)]
    model = runner.model
    forward, logits = model.forward, model.logits
    checked = _HostReads() if args.small else None

    def guarded(fn):
        def run(*a, **kw):
            if checked is not None:
                with checked:
                    return fn(*a, **kw)
            with _sync_mode("error"):
                out = fn(*a, **kw)
            return out

        return run

    model.forward, model.logits = guarded(forward), guarded(logits)
    try:
        runner.forward_eager(batch)  # raises on the GPU at a synchronising call
        sync()
    finally:
        model.forward, model.logits = forward, logits
    if checked is not None and checked.seen:
        raise SystemExit(f"sync: the forward read values back to the host: {checked.seen}")
    where = (
        "CPU stand-in: no value read back, no tensor from Python data"
        if args.small
        else ("no synchronisation under set_sync_debug_mode('error')")
    )
    print(f"- {name}, a decode step of {batch_size} sequences, the model's forward: {where}")
    out: dict = {"forward_syncs": 0}
    if not args.small:
        with warnings.catch_warnings(record=True) as caught, _sync_mode("warn"):
            warnings.simplefilter("always")
            runner.forward_eager(batch)
            sync()
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        out["step_syncs"] = len(syncs)
        print(f"- the whole eager step (inputs, plans, forward): {len(syncs)} synchronisations")
        for w in syncs[:8]:
            print(f"  - {str(w.message).splitlines()[0][:160]}")
    return out
