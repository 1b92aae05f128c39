"""kern.chat_formats: one object per chat format behind one registry, which the TOML checks, the
CLI, the splitter and the grammars read; nothing else names a format. (What each format's
parser and grammar do is tested through the splitter and the server: test_splitter,
test_tools, test_kimi_tools.)"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from kern.chat_formats import DEFAULT, FORMATS, REASONING_PARSERS, TOOL_PARSERS, reasoning_block
from kern.chat_formats.harmony import HARMONY
from kern.chat_formats.kimi_k2 import KIMI_K2
from kern.chat_formats.qwen3 import QWEN3

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "kern"
# The modules that read the formats: they take one from the registry, never test its name.
READERS = [
    *sorted((PACKAGE / "server").glob("*.py")),
    PACKAGE / "app.py",
    PACKAGE / "kern_toml.py",
    PACKAGE / "cli" / "serve.py",
    PACKAGE / "cli" / "serve_flags.py",
    PACKAGE / "engine" / "structured.py",
    PACKAGE / "engine" / "grammar_compile.py",
]


def test_the_registry():
    assert FORMATS == {"qwen3": QWEN3, "kimi_k2": KIMI_K2, "harmony": HARMONY}
    assert all(name == f.name for name, f in FORMATS.items())
    assert TOOL_PARSERS == ("qwen3", "kimi_k2", "harmony") and DEFAULT is QWEN3
    # harmony reads its own reasoning (its answers are messages): no reasoning_parser value.
    assert REASONING_PARSERS == ("qwen3",) and KIMI_K2.reasoning is None and HARMONY.messages
    assert reasoning_block(None) is None and reasoning_block("qwen3") is QWEN3.reasoning
    assert (QWEN3.keep_special, KIMI_K2.keep_special) == (False, True)


def test_each_format_parses_what_it_writes():
    body = '\n{"name": "get", "arguments": {"city": "Paris"}}\n'
    [call] = QWEN3.parse(body)
    assert (call.name, json.loads(call.arguments)) == ("get", {"city": "Paris"})
    assert call.id.startswith("call_")
    body = '<|tool_call_begin|>functions.get:3<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|>'
    [call] = KIMI_K2.parse(body)
    assert (call.id, call.name, call.arguments) == ("functions.get:3", "get", '{"a": 1}')
    assert QWEN3.parse("[1]") is None and KIMI_K2.parse("stray") is None


def test_the_package_is_torch_free_and_a_leaf():
    code = (
        "import sys\n"
        "import kern.chat_formats\n"
        "assert 'torch' not in sys.modules\n"
        "mods = {m for m in sys.modules if m.startswith('kern.')}\n"
        "assert all(m.startswith('kern.chat_formats') for m in mods), sorted(mods)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _constants(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of ``tree``, its docstrings left out."""
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_no_reader_names_a_format():
    named = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}"
        for path in READERS
        for node in _constants(ast.parse(path.read_text(encoding="utf-8")))
        if node.value in FORMATS
    ]
    assert not named, "\n".join(named)


def test_the_scan_finds_a_name():
    tree = ast.parse('"""qwen3"""\nx = "kimi_k2"\n')
    assert [c.value for c in _constants(tree)] == ["kimi_k2"]
