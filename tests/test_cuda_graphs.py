"""Decode CUDA graphs' host side (kern.engine.cuda_graphs), on the CPU: the size buckets, the
padding rows and their scratch page, the static buffers' copy-in, the captured function run
eagerly and making no host copy or sync, the capture at the app's load and its fallback to
eager, and the serve flag's refusal. Capture and replay themselves need a GPU:
tools/gpu/bench.py graphs checks them there."""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from support.scheduler import Harness, load
from torch.utils._python_dispatch import TorchDispatchMode

from kern.app import App
from kern.assets import default_model_path
from kern.backend import CudaOps
from kern.chunk import SeqChunk
from kern.engine.cuda_graphs import (
    MAX_SIZE,
    DecodeGraphs,
    StaticInputs,
    bucket,
    capture_sizes,
    graphs_at_load,
    is_decode,
    pad,
    start_graphs,
)
from kern.engine.runner import Runner
from kern.server.settings import Settings

PAGE = 16
PAGES = 12
SCRATCH = PAGES - 1
# three sequences: (prompt length, block table)
SEQS = [(5, [0]), (20, [1, 2]), (33, [3, 4, 5])]


@pytest.fixture(scope="module")
def qwen3(tiny):
    return tiny("qwen3")


def test_capture_sizes_and_buckets():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert capture_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(10_000)[-1] == MAX_SIZE
    with pytest.raises(ValueError, match="max_batch"):
        capture_sizes(0)
    sizes = capture_sizes(48)
    assert [bucket(n, sizes) for n in (1, 2, 3, 5, 17, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]
    assert bucket(49, sizes) is None


def test_pad_and_decode_batches():
    batch = [SeqChunk([7], 20, [1, 2]), SeqChunk([8], 4, [0])]
    padded = pad(batch, 4, SCRATCH)
    assert padded[:2] == batch
    assert padded[2:] == [SeqChunk([0], 0, [SCRATCH])] * 2
    assert pad(batch, 2, SCRATCH) == batch
    with pytest.raises(ValueError, match="cannot pad 2 rows to 1"):
        pad(batch, 1, SCRATCH)
    assert is_decode(padded)
    assert not is_decode([SeqChunk([7, 8], 20, [1, 2])])  # a verify chunk
    assert not is_decode([SeqChunk([7], 0, [1], logits="none")])


def test_static_inputs_copy_in():
    inputs = StaticInputs(8, 6, PAGE, SCRATCH, torch.device("cpu"))
    batch = [SeqChunk([7], 40, [3, 1, 4, 9]), SeqChunk([8], 15, [2])]
    inputs.fill(pad(batch, 4, SCRATCH))
    step = inputs.step(4)
    assert step.token_ids.tolist() == [7, 8, 0, 0]
    assert step.positions.tolist() == [40, 15, 0, 0]
    assert step.page_ids.tolist() == [4, 2, SCRATCH, SCRATCH]
    assert step.page_offsets.tolist() == [8, 15, 0, 0]
    assert step.slot_mapping.tolist() == [4 * PAGE + 8, 2 * PAGE + 15, SCRATCH * PAGE] + [
        SCRATCH * PAGE
    ]
    assert inputs.seq_lens[:4].tolist() == [41, 16, 1, 1]
    # a row's pages up to its length; padding rows read the scratch page alone
    assert step.block_tables[0, :3].tolist() == [3, 1, 4]
    assert step.block_tables[1, 0].item() == 2
    assert step.block_tables[2:, 0].tolist() == [SCRATCH, SCRATCH]
    assert step.q_lens == [1] * 4 and step.q_starts == [0, 1, 2, 3]
    assert step.logit_rows.tolist() == [0, 1, 2, 3]
    # each tensor is a view of the buffers the graph reads, never a copy
    assert step.token_ids.data_ptr() == inputs.rows.data_ptr()
    assert step.block_tables.data_ptr() == inputs.tables.data_ptr()
    # the next step overwrites the rows it fills
    inputs.fill([SeqChunk([9], 16, [5, 6])])
    assert inputs.step(1).slot_mapping.tolist() == [6 * PAGE]
    assert inputs.seq_lens[0].item() == 17 and inputs.tables[0, :2].tolist() == [5, 6]
    assert inputs.fits([SeqChunk([1], 6 * PAGE - 1, list(range(6)))])
    assert not inputs.fits([SeqChunk([1], 6 * PAGE, list(range(7)))])


def _prefilled(ckpt, ops=None) -> Runner:
    runner = Runner.with_pages(ckpt, num_pages=PAGES, page_tokens=PAGE, ops=ops)
    gen = torch.Generator().manual_seed(3)
    chunks = []
    for i, (n, table) in enumerate(SEQS):
        prompt = torch.randint(1, ckpt.config.vocab_size, (n,), generator=gen).tolist()
        chunks.append(SeqChunk(prompt, 0, table, slot=i))
    runner.forward(chunks)
    return runner


def _decode(n: int) -> list[SeqChunk]:
    return [SeqChunk([11 + i], SEQS[i][0], SEQS[i][1]) for i in range(n)]


def test_padding_keeps_a_real_rows_bits(qwen3):
    """The CPU backend's eager forward of the padded batch (the graph's stand-in): a real
    row's logits are the same bits unpadded and padded to 1, 2, 4, 8; the padding rows
    write the scratch page and nothing else."""
    runner = _prefilled(qwen3)
    assert not runner.kv_arena[SCRATCH].any()
    for n in (1, 3):
        want = runner.forward(_decode(n))
        arena = runner.kv_arena.clone()
        for size in (s for s in (1, 2, 4, 8) if s >= n):
            graphs = DecodeGraphs(runner, (size,), SCRATCH, 64, mode="padded")
            got = graphs.run(_decode(n))
            assert got is not None and graphs.replays == 1
            assert got.shape == want.shape
            assert torch.equal(got, want), f"{n} rows padded to {size}"
            # the real rows rewrote their own K/V with the same bits; padding wrote only
            # the scratch page (the same bits each time: token 0 at position 0)
            assert torch.equal(runner.kv_arena[:SCRATCH], arena[:SCRATCH])
            assert runner.kv_arena[SCRATCH].any() == (size > 1)


def test_runner_hands_decode_batches_to_the_graphs(qwen3):
    runner = _prefilled(qwen3)
    want = runner.forward(_decode(3))
    graphs = DecodeGraphs(runner, (1, 2, 4), SCRATCH, 64, mode="padded")
    runner.graphs = graphs
    assert torch.equal(runner.forward(_decode(3)), want)
    assert graphs.replays == 1
    # eager: a prompt chunk, a verify chunk, a batch past the largest size, kept hidden rows
    runner.forward([SeqChunk([1, 2], 0, [6])])
    runner.forward([SeqChunk([1, 2], 5, [0], logits="all")])
    runner.forward([SeqChunk([1], 2 + i, [6 + i]) for i in range(5)])
    runner.keep_hidden = True
    runner.forward(_decode(1))
    assert graphs.replays == 1
    runner.keep_hidden = False
    # a sequence longer than the tables the graphs were sized for runs eagerly too
    long = [SeqChunk([1], 4 * PAGE, [0, 1, 2, 3, 7])]
    narrow = DecodeGraphs(runner, (1,), SCRATCH, 4 * PAGE, mode="padded")
    assert narrow.run(long) is None
    # a malformed batch is refused before the graphs see it
    with pytest.raises(ValueError, match="outside"):
        runner.forward([SeqChunk([1], 3, [PAGES])])


def test_refusals(qwen3, tiny):
    runner = Runner.with_pages(qwen3, num_pages=PAGES, page_tokens=PAGE)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(runner, (1,), SCRATCH, 64)
    with pytest.raises(ValueError, match="scratch page 12 is outside"):
        DecodeGraphs(runner, (1,), PAGES, 64, mode="padded")
    moe = Runner.with_pages(tiny("qwen3_moe"), num_pages=PAGES, page_tokens=PAGE)
    with pytest.raises(ValueError, match="qwen3_moe reads device values back"):
        DecodeGraphs(moe, (1,), SCRATCH, 64, mode="padded")


class _InterpretedTritonOps(CudaOps):
    """The CUDA backend with its Triton kernels under the interpreter, float32 on the CPU."""

    dtype = torch.float32


def test_the_captured_function_over_static_buffers(qwen3, monkeypatch):
    """What a graph holds (the forward over the static buffers, the attention plan made
    before the capture), run eagerly with the CUDA backend's Triton kernels under the
    interpreter: the same bits as the eager forward of the padded batch, step after step
    (the buffers refilled), and the CPU backend's logits within float32 rounding."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    runner = _prefilled(qwen3, _InterpretedTritonOps(torch.device("cpu")))
    cpu = _prefilled(qwen3)
    graphs = DecodeGraphs(runner, (1, 4), SCRATCH, 64, mode="static")
    graphs.capture()
    for step in range(2):
        batch = [SeqChunk([11 + i], SEQS[i][0] + step, SEQS[i][1]) for i in range(3)]
        got = graphs.run(batch)
        assert got is not None and got.shape == (3, qwen3.config.vocab_size)
        want = runner.forward_eager(pad(batch, 4, SCRATCH))[:3]
        assert torch.equal(got, want), f"step {step}"
        torch.testing.assert_close(got, cpu.forward(batch), atol=1e-4, rtol=0)
    assert graphs.replays == 2


def test_enforce_eager_is_refused_on_the_cpu():
    out = subprocess.run(
        [sys.executable, "-m", "kern.cli", "serve", "--enforce-eager", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "--enforce-eager: device cpu never captures CUDA graphs" in out.stderr


class _NoHostWork(TorchDispatchMode):
    """Fails on a value read back to the host (``.item()``, ``.tolist()``: one
    ``_local_scalar_dense`` each) or a tensor made from Python data (``torch.tensor``), which
    on a GPU are a sync and a host-to-device copy: neither can be captured."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "_local_scalar_dense" in name or "lift_fresh" in name:
            raise AssertionError(f"the captured forward calls {name}")
        return func(*args, **(kwargs or {}))


def test_the_captured_forward_makes_no_host_copy_or_sync(qwen3, monkeypatch):
    """The graph's body on the CUDA backend's wiring (Triton under the interpreter): after the
    warm-up a capture runs first, no read-back, no tensor from host data, and no tensor made
    without the device (torch's default device is "meta" meanwhile: a host-made table copied
    to the device, as the RoPE frequencies once were in every layer, fails loudly)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    runner = _prefilled(qwen3, _InterpretedTritonOps(torch.device("cpu")))
    graphs = DecodeGraphs(runner, (4,), SCRATCH, 64, mode="static")
    graphs.capture()
    graphs.inputs.fill(pad(_decode(3), 4, SCRATCH))
    want = graphs._body(4)  # the warm-up (compiles, fills the backend's device tables)
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        with _NoHostWork():
            got = graphs._body(4)
    finally:
        torch.set_default_device(previous)
    assert got.device.type == "cpu" and torch.equal(got, want)


def _engine(tiny_dir):
    return load(tiny_dir("qwen3"), pool_bytes=2**20)


def test_graphs_are_captured_at_load_and_a_failed_capture_decodes_eagerly(
    tiny_dir, monkeypatch, caplog
):
    """``start_graphs`` (the padded stand-in on the CPU): a capture sets the runner's graphs
    and takes a scratch page; one that fails logs why in one line, gives the page back and
    leaves an eager server that answers the same."""
    engine = _engine(tiny_dir)
    h = _ScratchHarness(engine)
    free = engine.cache.stats().pages_free
    words = start_graphs(engine, h.sched, max_len=256, mode="padded")
    assert words.startswith("cuda graphs at batch 1,2,4")
    assert engine.runner.graphs is not None and engine.cache.stats().pages_free == free - 1
    want = _answer(h)
    assert engine.runner.graphs.replays > 0  # the decode steps went through the stand-in

    failing = _engine(tiny_dir)
    h2 = Harness(failing)  # its books count every page: the scratch page must be back
    max_pages = h2.sched.max_pages

    def boom(self):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(DecodeGraphs, "capture", boom)
    with caplog.at_level(logging.WARNING, logger="kern"):
        words = start_graphs(failing, h2.sched, max_len=256, mode="padded")
    assert words == (
        "eager (capture failed: RuntimeError: operation not permitted when stream is capturing)"
    )
    assert [r.getMessage() for r in caplog.records] == [
        "decode graphs: capture failed, decoding eagerly (RuntimeError: operation not "
        "permitted when stream is capturing)"
    ]
    assert failing.runner.graphs is None and h2.sched.max_pages == max_pages
    assert failing.cache.stats().pages_free == free
    assert _answer(h2) == want


class _ScratchHarness(Harness):
    """The books of a server with graphs: one page (the padding rows') held by no request."""

    def check_books(self) -> None:
        self.cache.check_integrity()
        s = self.cache.stats()
        listed = sum(len(r.block_table) for r in self.sched._running)
        assert s.resident_pages + 1 <= s.pages_used <= s.resident_pages + listed + 1


def _answer(h: Harness) -> list[int]:
    req = h.submit(list(range(3, 40)), 8)
    h.run()
    return h.answer(req)


def test_the_app_captures_at_load_under_any_server(monkeypatch):
    """``App._load`` calls ``graphs_at_load`` (so ``hypercorn kern.app:app`` gets graphs as
    ``kern serve`` does): it captures on CUDA unless ``--enforce-eager`` /
    ``KERN_ENFORCE_EAGER``, and does nothing on the CPU."""
    calls = []
    monkeypatch.setattr(
        "kern.engine.cuda_graphs.start_graphs",
        lambda e, s, max_len: calls.append(max_len) or "graphs",
    )
    cuda = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cuda")))
    cpu = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cpu")))
    assert graphs_at_load(cuda, None, max_len=512, eager=False) == "graphs" and calls == [512]
    assert graphs_at_load(cpu, None, max_len=512, eager=False) == "" and calls == [512]
    assert graphs_at_load(cuda, None, max_len=512, eager=True) == "eager (--enforce-eager)"
    assert calls == [512]
    assert "graphs_at_load(" in inspect.getsource(App._load)
    monkeypatch.setenv("KERN_ENFORCE_EAGER", "1")
    monkeypatch.setenv("KERN_MODEL", str(default_model_path()))
    assert Settings.from_env().enforce_eager
    monkeypatch.setenv("KERN_ENFORCE_EAGER", "0")
    assert not Settings.from_env().enforce_eager
