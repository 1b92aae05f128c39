"""kern.bench.prefix on a small trace: both trees agree (the run fails otherwise), the table
and ratios print, and --export writes the layout the floor model reads."""

from __future__ import annotations

import numpy as np
import pytest

from kern.bench import prefix


def test_small_run_prints_the_table_and_exports_the_trace(tmp_path, capsys):
    out = tmp_path / "floor"
    prefix.main(
        ["--requests", "30,60", "--page-tokens", "1,4", "--runs", "1", "--export", str(out)]
    )
    text = capsys.readouterr().out
    assert text.count("identical hits") == 4
    assert "60 requests, page 4: kern is" in text
    assert "page 1: kern's per-request cost at 60 / at 30 requests" in text

    t = prefix.make_trace(60, 0)
    raw = (out / "trace_60.bin").read_bytes()
    assert raw[:8] == b"KERNTRC1"
    sessions, ops = np.frombuffer(raw, "<u8", 2, 8)
    assert (sessions, ops) == (len(t.sessions), 120)
    at = 24
    offsets = np.frombuffer(raw, "<u8", sessions + 1, at)
    at += 8 * (sessions + 1)
    template = np.frombuffer(raw, "<u8", sessions, at)
    at += 8 * sessions
    template_len = np.frombuffer(raw, "<u8", sessions, at)
    at += 8 * sessions
    quads = np.frombuffer(raw, "<u8", 4 * ops, at).reshape(ops, 4)
    at += 32 * ops
    tokens = np.frombuffer(raw, "<u4", offsets[-1], at)
    assert at + 4 * offsets[-1] == len(raw)
    assert tokens.tobytes() == np.concatenate(t.sessions).astype("<u4").tobytes()
    for s, x in enumerate(t.sessions):
        k = template[s]
        # a conversation starts with its system prompt, which every conversation of it shares
        assert template_len[s] == t.template_len[k] and offsets[s + 1] - offsets[s] == len(x)
    assert [tuple(q) for q in quads] == [
        (kind, t.req_session[r], t.req_prompt[r], t.req_full[r]) for kind, r in t.ops
    ]
    for pt in (1, 4):
        hits = np.fromfile(out / f"hits_60_p{pt}.bin", "<u8")
        assert len(hits) == 60 and (hits <= np.asarray(t.req_prompt)).all() and hits.any()


def test_bad_arguments_are_named(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit):
        prefix.main(["--requests", "30", "--export", str(blocker / "sub")])
    assert f"--export {blocker / 'sub'}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prefix.main(["--requests", "0"])
    assert "must be positive" in capsys.readouterr().err
