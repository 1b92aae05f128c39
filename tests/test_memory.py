"""Memory is the budget: the runner's arenas equal ``pool_bytes`` and ``host_bytes`` (within one
chunk) for every family, every page and slot view aliases the one device arena, and a served
stateful target's resident memory stays within model + budgets + a fixed overhead."""

from __future__ import annotations

import os

import pytest
import torch
from support.scheduler import load
from support.server import Server

from kern.tiny import make_tiny

MIB = 2**20
# What a kern server process holds besides its weights and arenas (the interpreter, torch,
# hypercorn, tokenizer, activations of the tiny models): 549 MiB peak was measured on
# the CI machine (a 2-core x86-64 VM, torch 2.13 CPU); the bound leaves room above that.
FIXED_OVERHEAD = 700 * MIB


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "qwen3_moe", "deepseek_v3", "kimi_linear"])
@pytest.mark.parametrize("pool, host", [(8 * MIB, 4 * MIB), (3 * MIB + 12345, 0)])
def test_arenas_equal_the_budgets(tiny_dir, family, pool, host):
    engine = load(tiny_dir(family), pool_bytes=pool, host_bytes=host, page_tokens=16)
    runner, geometry = engine.runner, engine.cache.device
    device_bytes, host_bytes = engine.arena_bytes
    assert pool - geometry.chunk_bytes < device_bytes <= pool
    if host:
        assert engine.cache.host is not None
        assert host - engine.cache.host.chunk_bytes < host_bytes <= host
    else:
        assert host_bytes == 0 and runner.host is None
    # Pages and slots are views of that one buffer, not arrays of their own.
    base = runner.arena.buffer.untyped_storage().data_ptr()
    views = [runner.kv_arena, runner.conv_states, runner.delta_states]
    for view in views:
        if view is not None:
            assert view.untyped_storage().data_ptr() == base
    # Every page id and every slot id the pool can hand out is addressable in the views.
    assert runner.kv_arena.shape[0] == geometry.num_pages
    if engine.layout.stateful:
        assert runner.delta_states.shape[0] == geometry.num_slots >= 2
        last = geometry.num_slots - 1
        end = runner.delta_states[last].data_ptr() + engine.layout.delta_bytes
        assert end <= base + device_bytes
    else:
        assert runner.conv_states is None and runner.delta_states is None


def test_a_slot_and_the_pages_it_took_are_the_same_bytes(tiny_dir):
    """Slot growth re-labels bytes: a state written into a slot shows through the page view
    of the same chunk (and no copy was needed to make the slot)."""
    engine = load(tiny_dir("qwen3_5"), pool_bytes=MIB, page_tokens=16)
    runner, cache = engine.runner, engine.cache
    slots = [cache.alloc_slot() for _ in range(3)]  # the third takes a chunk from the pages
    s = slots[-1]
    runner.delta_states[s].fill_(1.0)
    g = cache.device
    offset = s * g.slot_stride
    page = offset // g.page_bytes
    rows = runner.arena.page_rows[page].view(torch.float32)
    assert bool((rows == 1.0).any())
    for slot in slots:
        cache.free_slot(slot)


def _rss_peak(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_a_stateful_server_stays_within_its_budgets(tmp_path):
    ckpt = make_tiny("qwen3_5", tmp_path / "q35", seed=2)
    model_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    peaks = {}
    for name, pool, host in (("small", "1MiB", "0"), ("big", "256MiB", "512MiB")):
        srv = Server(tmp_path, name, pool_bytes=pool, host_bytes=host, checkpoint=ckpt)
        try:
            out = srv.complete(list(range(3, 40)), 8, ignore_eos=True)
            assert len(out["choices"][0]["token_ids"]) == 8
            peaks[name] = _rss_peak(srv.proc.pid)
        finally:
            srv.close()
    budgets = 256 * MIB + 512 * MIB
    small, big = peaks["small"] / MIB, peaks["big"] / MIB
    print(f"peak RSS: 1 MiB pool {small:.0f} MiB, 256 + 512 MiB {big:.0f} MiB")
    assert peaks["big"] <= model_bytes + budgets + FIXED_OVERHEAD
    # Against the same server on a 1 MiB pool: the budgets add at most themselves (before,
    # a stateful target took twice its pool and twice its host tier).
    assert peaks["big"] - peaks["small"] <= budgets + 32 * MIB


class _PlainHits:
    """K/V pages' hit rule (kern.models.pages.Pages): every resident hit is exact."""

    prompt_snapshots = False

    def hit_key(self, tokens):
        return tokens

    def exact_hit(self, match, hit) -> int:
        return hit


class _NoBytes:
    """A runner that moves no bytes: the cache's books alone."""

    stateful = False
    pages = _PlainHits()

    def park(self, plans) -> None:
        pass

    def wake(self, plan) -> None:
        pass

    def copy_pages(self, src, dst) -> None:
        pass

    def copy_slots(self, src, dst) -> None:
        pass


def test_a_repeat_wakes_its_whole_parked_entry():
    """A repeated prompt whose cached entry (prompt and answer, 3 pages) was parked must be
    woken, evicting what the wake needs: room sized by the hit (1 page, with 2 free) evicted
    nothing, the wake was refused and the prompt recomputed (found by the e2e gate's warm
    scenario on a 56-page pool)."""
    from kern.arith import cdiv
    from kern.engine.memory import Memory
    from kern.engine.request import Request
    from kern.metrics import Metrics
    from kern.pool import Cache

    page_tokens, page_bytes = 16, 4096
    cache = Cache(
        page_tokens=page_tokens,
        page_bytes=page_bytes,
        device_bytes=5 * page_bytes,
        host_bytes=64 * page_bytes,
    )
    metrics = Metrics()
    memory = Memory(cache, _NoBytes(), metrics, running=[])

    def serve(prompt: list[int], answer: list[int]) -> int:
        req = Request(list(prompt), len(answer))
        req.tokens = list(prompt)
        assert memory.admit(req)
        cached = req.cached_tokens
        req.tokens += answer
        req.num_computed = len(req.tokens)
        req.block_table += memory.take_pages(
            cdiv(len(req.tokens), page_tokens) - len(req.block_table)
        )
        memory.release(req, snapshot=False)
        return cached

    a = [1, 2, 3, 4, 5]
    serve(a, list(range(1000, 1035)))  # 40 tokens: 3 pages
    serve(list(range(100, 120)), list(range(2000, 2012)))  # 2 pages
    serve(list(range(200, 210)), list(range(3000, 3006)))  # 1 page: parks a's entry
    assert metrics.value("kern_parked_total") == 1 and cache.pages_free == 2
    assert serve(a, list(range(1000, 1035))) == len(a) - 1  # woken, not recomputed
    assert metrics.value("kern_dropped_resident_total") == 0
    assert metrics.value("kern_dropped_parked_total") == 0
