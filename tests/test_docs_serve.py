"""The API examples of docs/serve.md (the blocks after ``<!-- tested -->``) run against `kern
serve` on the embedded model, as written but for the port."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "e2e"))

from http_client import ServerProcess  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "serve.md"
BLOCK = re.compile(r"<!-- tested -->\n```(sh|python)\n(.*?)```", re.DOTALL)


def _blocks() -> list[tuple[str, str]]:
    return BLOCK.findall(DOC.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("docs") / "serve.log"
    # No --config: the embedded model, as the examples assume.
    with ServerProcess([sys.executable, "-m", "kern.cli"], None, None, log, start_limit=120) as s:
        yield s


def test_the_doc_has_curl_and_openai_examples():
    kinds = [kind for kind, _ in _blocks()]
    assert kinds.count("sh") >= 3 and kinds.count("python") >= 1


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_example_runs(server, index):
    assert shutil.which("curl"), "the curl examples need curl"
    kind, code = _blocks()[index]
    code = code.replace(":8000", f":{server.port}")
    cmd = ["bash", "-euo", "pipefail", "-c", code] if kind == "sh" else [sys.executable, "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "error" not in out.stdout, out.stdout
    text = out.stdout.strip()
    if text.startswith("{"):
        # One JSON answer per curl, back to back (curl adds no newline): each parses.
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(text):
            _, pos = decoder.raw_decode(text, pos)
            pos += len(text[pos:]) - len(text[pos:].lstrip())
    assert server.alive()
