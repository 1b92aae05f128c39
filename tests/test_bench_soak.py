"""The soak benchmark (kern.bench.soak) end to end, briefly: it starts its own ``kern serve``,
loads it for 20 s at low concurrency with every kind of request, and its report holds what a
soak must show (no 5xx, hang-ups noticed, the books balanced once idle). Memory flatness needs
minutes, so the verdict itself is not asserted here."""

from __future__ import annotations

import re

from kern.bench import soak


def test_soak_runs_and_balances(capsys):
    soak.main(["--minutes", "0.34", "--concurrency", "4", "--sample-seconds", "5"])
    out = capsys.readouterr().out
    status = re.search(r"status (\d+) 2xx, (\d+) 4xx, (\d+) 5xx, (\d+) other", out)
    assert status, out
    ok, refused, errors, other = map(int, status.groups())
    assert ok > 0 and refused > 0 and errors == 0 and other == 0, out
    faults = ("timeouts", "transport errors", "streams cut short", "unreadable answers")
    for fault in (*faults, "bad bodies accepted"):
        assert re.search(rf"{fault} 0\b", out), out
    assert "well-formed requests refused 0" in out, out
    assert re.search(r"hang-ups [1-9]", out), out
    assert ": balanced" in out, out
    assert ": back" in out, out  # the fds came back once the connections closed
    assert "server exit code after SIGTERM: 0" in out, out
    # at least two samples of the table: the start and the end
    assert len(re.findall(r"^\s+\d+\.\d \s+\d+ \s+\d+\.\d", out, re.M)) >= 2, out
