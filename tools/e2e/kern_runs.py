"""Many `kern run` command lines in one process, for the gate's oracle (oracle.py).

    python tools/e2e/kern_runs.py < commands.jsonl > results.jsonl

Each input line is a JSON list: the arguments of one `kern` command (``["run", "--config", C,
"--target", T, "--prompt", "hi", "--steps", "32", "--rows", "1", "--json"]``). Each runs through
kern's own entry point, ``kern.cli.main`` (what the ``kern`` command runs), alone and in order,
and prints one JSON line: ``{"rc": exit code, "out": its stdout, "err": the end of its stderr}``.

Why: a `kern run` process spends about two seconds importing torch and kern before it computes
anything, and the gate asks for some 15 to 30 answers a target. One process for them pays
that once. Nothing else is shared between the commands: each selects its target, loads its
checkpoint, pins its thread count and builds its runner, as the command does, so its answer
is the command's bit for bit (tests/test_e2e.py compares them).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback


def run_one(argv: list[str]) -> dict[str, object]:
    from kern.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's errors and --help
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - reported as the command would: exit 1, a traceback
            traceback.print_exc()
            rc = 1
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue()[-4000:]}


def main() -> int:
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run_one(json.loads(line)), ensure_ascii=False), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
