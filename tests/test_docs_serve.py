"""docs/serve.md and docs/cli.md are what kern does.

* The API examples of docs/serve.md and docs/agents.md (the blocks after ``<!-- tested -->``)
  run against the ``kern serve`` its ``<!-- server -->`` block shows (the embedded model), as
  written but for the port, and that server's start-up line is the one the block shows.
* Every ``$ command`` of an ``<!-- errors -->`` block runs, and prints exactly the lines below it
  on stderr (nothing on stdout) and exits 2 (``kern``) or fails (``hypercorn``); likewise the
  stderr of a ``<!-- stderr -->`` block's command, and the JSON a ``<!-- stdout: kern ... -->``
  or ``<!-- file PATH: kern ... -->`` block shows is what that command prints or writes.
* Every ``kern`` command of a shell block parses with kern's own parser, every ``kern ...`` in
  backticks names only flags its command takes, a ``<!-- synopsis -->`` line only the flags and
  positional arguments the command takes; every flag of every command is in its section of
  the docs, and every ``KERN_*`` variable the server reads is in docs/serve.md.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "e2e"))

from http_client import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "serve.md"
CLI_DOC = ROOT / "docs" / "cli.md"
# The agent protocols' examples (Anthropic Messages, OpenAI Responses) run on the same server.
AGENTS_DOC = ROOT / "docs" / "agents.md"
BLOCK = re.compile(r"<!-- tested -->\n```(sh|python)\n(.*?)```", re.DOTALL)
# A fenced block, maybe indented (in a list item), after an optional <!-- kind --> marker.
FENCE = re.compile(r"(?:<!-- (\w+) -->\n)?^( *)```(\w*)\n(.*?)^\2```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[str, str]]:
    return [b for doc in (DOC, AGENTS_DOC) for b in BLOCK.findall(doc.read_text(encoding="utf-8"))]


def _fences(doc: Path) -> list[tuple[str | None, str, str]]:
    """Every fenced block of ``doc``: its marker (or None), language and text (dedented)."""
    out = []
    for kind, indent, lang, text in FENCE.findall(doc.read_text(encoding="utf-8")):
        lines = [line.removeprefix(indent) for line in text.splitlines()]
        out.append((kind or None, lang, "\n".join(lines) + "\n"))
    return out


def _transcripts(kind: str) -> list[tuple[str, str, list[str]]]:
    """``(doc, command, lines)``: each ``$ command`` of the ``kind`` blocks of both docs and
    the lines shown below it."""
    out: list[tuple[str, str, list[str]]] = []
    for doc in (CLI_DOC, DOC):
        for marker, _, text in _fences(doc):
            if marker != kind:
                continue
            for line in text.splitlines():
                if line.startswith("$ "):
                    out.append((doc.name, line[2:], []))
                else:
                    assert out, f"{doc.name}: a {kind} block starts without '$ '"
                    out[-1][2].append(line)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("docs") / "serve.log"
    [(_, command, _)] = _transcripts("server")
    argv = shlex.split(command)
    assert argv[:2] == ["kern", "serve"], command
    # The embedded model, as the examples assume; the port is the test's.
    kern = [sys.executable, "-m", "kern.cli"]
    with ServerProcess(kern, None, None, log, start_limit=120, extra=tuple(argv[2:])) as s:
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
    text = out.stdout.strip()
    if text.startswith("{"):
        # One JSON answer per curl, back to back (curl adds no newline): each parses, and
        # none is an error (OpenAI's shape or Anthropic's; a Response has "error": null).
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(text):
            value, pos = decoder.raw_decode(text, pos)
            assert value.get("error") is None and value.get("type") != "error", value
            pos += len(text[pos:]) - len(text[pos:].lstrip())
    else:
        assert "error" not in out.stdout, out.stdout
    assert server.alive()


# --- the start-up line ----------------------------------------------------------------------


def _start_up_line(line: str) -> str:
    """The parts of a start-up line that vary with the machine, made the same."""
    line = re.sub(r"^\S+ \S+ INFO kern \S+ serving ", "INFO kern VERSION serving ", line)
    line = re.sub(r" from \S+ on ", " from CHECKPOINT on ", line)
    line = re.sub(r"; linears in MKL tiles \([^)]*\)", "", line)
    return re.sub(r"http://127\.0\.0\.1:\d+$", "http://127.0.0.1:PORT", line)


def test_the_start_up_line_is_the_documented_one(server):
    [(_, _, [documented])] = _transcripts("server")
    lines = [x for x in server.log_path.read_text().splitlines() if " serving " in x]
    assert len(lines) == 1, lines
    assert _start_up_line(lines[0]) == _start_up_line(documented)


# --- error messages -------------------------------------------------------------------------

# (kind, doc, command, lines): an errors example fails with its lines; a stderr one succeeds.
EXAMPLES = [("errors", *t) for t in _transcripts("errors")]
EXAMPLES += [("stderr", *t) for t in _transcripts("stderr")]
TOML = """\
[targets.g]
checkpoint = "models/tiny-qwen3"
device = "cuda"
dtype = "float32"

[targets.big]
checkpoint = "models/tiny-qwen3"
ranks = 8

[targets.spec]
checkpoint = "models/tiny-qwen3"
rows = [1, 4]

[targets.tp2]
checkpoint = "models/tiny-qwen3"
ranks = 2
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Where the examples run: ``kern.toml`` with the targets the docs name, ``typo.toml`` with
    a misspelt key, ``models/`` for the docs' ``/models/`` (the embedded model as
    ``tiny-qwen3``, a ``llama`` config, an empty folder, a template that does not compile),
    and a port in use for the docs' 8000."""
    from kern.tiny import default_model_path

    work = tmp_path_factory.mktemp("docs-errors")
    models = work / "models"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "config.json").write_text('{"model_type": "llama"}')
    (models / "empty").mkdir()
    (models / "tiny-qwen3").symlink_to(default_model_path())
    (models / "bad.jinja").write_text("{% for %}")
    (work / "kern.toml").write_text(TOML)
    (work / "typo.toml").write_text(
        '[targets.big]\ncheckpoint = "models/tiny-qwen3"\npage_token = 32\n'
    )
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield work, held.getsockname()[1]


def _here(text: str, work: Path, port: int) -> str:
    """A docs example's text as it runs here: /models/ is the workdir's, 8000 the held port."""
    return re.sub(r"\b8000\b", str(port), text.replace("/models/", f"{work}/models/"))


@pytest.mark.parametrize(
    ("kind", "doc", "command", "lines"), EXAMPLES, ids=[e[2] for e in EXAMPLES]
)
def test_the_documented_messages_are_what_kern_prints(workdir, kind, doc, command, lines):
    work, port = workdir
    words = shlex.split(_here(command, work, port))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERN_")}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[0] == "kern":
        argv = [sys.executable, "-m", "kern.cli", *words[1:]]
    else:
        assert words[:2] == ["hypercorn", "kern.app:app"], command
        argv = [sys.executable, "-m", "hypercorn", *words[1:], "--bind", "127.0.0.1:0"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=work, env=env)
    expected = _here("\n".join(lines), work, port) + "\n"
    if kind == "stderr":  # it succeeds; a line may end with the model's path, the machine's
        assert out.returncode == 0, out.stderr
        path = re.compile(r"(?m), /\S+$")
        assert path.sub(", PATH", out.stderr) == path.sub(", PATH", expected), f"{doc}: {command}"
        return
    assert out.stderr == expected, f"{doc}: {command}"
    assert out.stdout == ""
    if words[0] == "kern":
        assert out.returncode == 2
    else:
        assert out.returncode != 0  # hypercorn's supervisor, ended (see kern.server.startup)


# --- commands, synopses, flags and variables ------------------------------------------------


def _parser():
    from kern.cli import _parser

    return _parser()


def _subparsers() -> dict:
    parser = _parser()
    [sub] = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return dict(sub.choices)


def _shell_commands() -> list[tuple[str, list[str]]]:
    """``(doc, argv)`` of every ``kern`` command in the docs' shell blocks (environment
    assignments dropped, comments and line continuations read as a shell would)."""
    out = []
    for doc in (CLI_DOC, DOC):
        for _, lang, text in _fences(doc):
            if lang != "sh":
                continue
            for line in text.replace("\\\n", " ").splitlines():
                if not re.match(r"\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*kern\s", line):
                    continue
                words = shlex.split(line, comments=True)
                while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                    words.pop(0)
                if words[:1] == ["kern"]:
                    out.append((doc.name, words[1:]))
    return out


def test_every_shell_command_parses(capsys):
    commands = _shell_commands()
    assert len(commands) >= 10
    for doc, argv in commands:
        try:
            _parser().parse_args(argv)
        except SystemExit as e:
            assert e.code == 0, f"{doc}: kern {shlex.join(argv)}: {capsys.readouterr().err}"


def _flags_exist(sub: str, words: list[str], where: str) -> list[str]:
    """The positional placeholders among ``words`` (a synopsis or an example of ``kern
    sub``), after checking each ``--flag`` is one ``sub`` takes."""
    parser = _subparsers()[sub]
    takes = {s: a for a in parser._actions for s in a.option_strings}
    positional: list[str] = []
    skip = False
    for word in words:
        word = word.strip("[]()|")
        if skip or not word or word in ("options", "...", "|"):
            skip = False
            continue
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in takes, f"{where}: kern {sub} takes no {flag}"
            skip = takes[flag].nargs != 0 and "=" not in word
        else:
            positional.append(word)
    return positional


def test_every_synopsis_names_real_flags_and_positionals():
    lines = []
    for doc in (CLI_DOC, DOC):
        for kind, _, text in _fences(doc):
            if kind == "synopsis":
                # An indented line continues the one above.
                lines += [line.split() for line in text.replace("\n ", " ").splitlines()]
    assert len(lines) >= 9
    subs = _subparsers()
    for words in lines:
        assert words[0] == "kern"
        if words[1] == "--version":
            continue
        sub = words[1]
        assert sub in subs, words
        positional = _flags_exist(sub, words[2:], "synopsis")
        takes = [a.metavar or a.dest.upper() for a in subs[sub]._actions if not a.option_strings]
        assert positional == takes, f"synopsis of kern {sub}: {positional} != {takes}"


def test_every_kern_command_in_backticks_names_real_flags():
    subs = _subparsers()
    found = 0
    for doc in (CLI_DOC, DOC):
        text = doc.read_text(encoding="utf-8")
        for span in re.findall(r"`(kern [a-z-]+(?: [^`]*)?)`", text, re.DOTALL):
            words = span.split()
            if words[1] not in subs:
                continue
            found += 1
            _flags_exist(words[1], words[2:], f"{doc.name}: `{span}`")
    assert found >= 10


SECTIONS = {
    "make-tiny": [(CLI_DOC, "## kern make-tiny")],
    "run": [(CLI_DOC, "## kern run"), (CLI_DOC, "## Choosing the model")],
    "test": [(CLI_DOC, "## kern test"), (CLI_DOC, "## Choosing the model")],
    "serve": [(DOC, "## Start a server")],
    "bench": [(DOC, "## kern bench")],
}


def _section(doc: Path, heading: str) -> str:
    text = doc.read_text(encoding="utf-8")
    start = text.index("\n" + heading)
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def test_every_flag_is_documented_in_its_section():
    for sub, parser in _subparsers().items():
        text = "".join(_section(doc, heading) for doc, heading in SECTIONS[sub])
        for action in parser._actions:
            for flag in action.option_strings:
                if flag in ("-h", "--help"):
                    continue
                assert re.search(re.escape(flag) + r"(?![\w-])", text), f"kern {sub} {flag}"


def test_every_server_variable_is_documented():
    import kern.server.settings

    source = Path(kern.server.settings.__file__).read_text(encoding="utf-8")
    names = set(re.findall(r"\bKERN_[A-Z_]+\b", source))
    assert {"KERN_MODEL", "KERN_MAX_MODEL_LEN", "KERN_ALLOWED_ORIGINS"} <= names
    text = _section(DOC, "## Start a server")
    for name in sorted(names):
        assert f"`{name}`" in text, name


def test_the_documented_json_output_is_what_kern_prints(tmp_path):
    """A ``<!-- stdout: kern ... -->`` JSON block is that command's output (on the embedded
    model; ``model`` is the machine's path)."""
    marked = re.findall(
        r"<!-- stdout: (kern [^>]*?) -->\n```json\n(.*?)```", CLI_DOC.read_text(), re.DOTALL
    )
    assert marked
    for command, text in marked:
        argv = [sys.executable, "-m", "kern.cli", *shlex.split(command)[1:]]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        got, want = json.loads(out.stdout), json.loads(text)
        assert got.pop("model").endswith("/tiny-qwen3") and want.pop("model")
        assert got == want, command


def test_the_documented_probe_file_is_what_kern_writes(tmp_path):
    """A ``<!-- file PATH: kern ... -->`` JSON block is the file that command writes (the
    logits to 1e-5: the last bits of a float32 CPU logit may vary between machines)."""
    marked = re.findall(
        r"<!-- file (\S+): (kern [^>]*?) -->\n```json\n(.*?)```", CLI_DOC.read_text(), re.DOTALL
    )
    assert marked
    for path, command, text in marked:
        argv = [sys.executable, "-m", "kern.cli", *shlex.split(command)[1:]]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        got, want = json.loads((tmp_path / path).read_text()), json.loads(text)
        got.pop("logits_f32_bits"), want.pop("logits_f32_bits")
        logits = zip(got.pop("logits"), want.pop("logits"), strict=True)
        assert max(abs(a - b) for a, b in logits) < 1e-5, command
        assert got == want, command
