"""A coding agent's tool set under a grammar, what it costs: ``python -m kern.bench.tool_grammars``.

With the server's budget (``--timeout`` CPU seconds: the compiler process checks each source,
this process compiles it again, kern.engine.grammar_compile), on the embedded tiny model's
vocabulary (``--tokenizer DIR`` for another), the wall time of
``Grammars.submit(...).result()``:

* the whole structural tag of the tool list for "auto" (what every choice compiled before the
  lazy matcher, and still compiles in a format that is not ``calls_lazy``), one tool and all;
* tool_choice "auto" held lazily (kern.engine.tool_calls.submit_tools): the first request
  with all the tools (each compiled alone), a request with a superset of a first half (only
  the new ones compile), the same list again (all cached).

``--tools FILE``: a JSON list of tools in OpenAI's shape (``{"type": "function", "function":
{...}}``), Anthropic's (``{"name", "input_schema"}``) or kern's (``{"name", "parameters"}``);
the default is :func:`agent_tools`, a synthetic agent-sized list written for kern.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

# (name, what it does, its parameters: (name, JSON schema, required)) of a made-up coding agent.
_STR: dict[str, Any] = {"type": "string"}
_INT: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 100000}
_BOOL: dict[str, Any] = {"type": "boolean"}
_VERBS = (
    "read_file open_path write_file edit_file multi_edit glob_files grep_text list_dir run_shell "
    "kill_shell shell_output fetch_url search_web plan_tasks update_task spawn_agent message_agent "
    "notebook_cell ask_user lint_files run_tests git_status apply_patch record_note"
).split()


def _prose(topic: str, n: int) -> str:
    """``n`` sentences about ``topic``: a description as long as real agents send."""
    parts = (
        f"The {topic} is checked before anything runs, and a bad value is reported back",
        f"Give the {topic} exactly as the user wrote it unless they asked for a change",
        f"When the {topic} is left out the tool uses its default and says which it used",
        f"Long values of the {topic} are cut at the limit and the cut is reported",
        f"Never guess a {topic}: ask for it when nothing in the conversation gives it",
    )
    return " ".join(parts[i % len(parts)] + "." for i in range(n))


def _tool(k: int, name: str) -> dict[str, Any]:
    """Tool ``k`` of :func:`agent_tools`: a few typed parameters, an enum, a bounded list of
    objects, most of them required, every one described."""
    props: dict[str, Any] = {
        "path": {**_STR, "description": _prose("path", 4 + k % 3)},
        "mode": {
            "enum": ["fast", "full", "dry-run", f"level-{k}"],
            "description": _prose("mode", 3),
        },
        "limit": {**_INT, "description": _prose("line limit", 3)},
        "recursive": {**_BOOL, "description": _prose("recursion flag", 2)},
        "items": {
            "type": "array",
            "maxItems": 16,
            "description": _prose("list of changes", 3),
            "items": {
                "type": "object",
                "properties": {
                    "old": {**_STR, "description": _prose("old text", 2)},
                    "new": {**_STR, "description": _prose("new text", 2)},
                    "all": {**_BOOL, "description": _prose("replace-all flag", 1)},
                },
                "required": ["old", "new"],
                "additionalProperties": False,
            },
        },
    }
    if k % 2:
        props["timeout_ms"] = {**_INT, "description": _prose("timeout", 2)}
    if k % 3 == 0:
        props["tags"] = {"type": "array", "items": _STR, "description": _prose("tag list", 2)}
    return {
        "name": name,
        "description": _prose(name.replace("_", " "), 6),
        "parameters": {
            "type": "object",
            "properties": props,
            "required": ["path", "mode"] + (["items"] if k % 4 == 0 else []),
            "additionalProperties": False,
        },
    }


def agent_tools() -> list[dict[str, Any]]:
    """24 tools in kern's shape (``{"name", "description", "parameters"}``), about 70 KB of
    JSON, shaped like a coding agent's (file, shell, web, task and agent tools)."""
    return [_tool(k, name) for k, name in enumerate(_VERBS)]


def load_tools(path: Path) -> list[dict[str, Any]]:
    """A tool list from ``path`` in any of the shapes the module's docstring names."""
    out = []
    for t in json.loads(path.read_text()):
        t = t.get("function", t)
        out.append({"name": t["name"], "parameters": t.get("parameters", t.get("input_schema"))})
    return out


def _timed(fn: Any) -> tuple[float, str]:
    t0 = time.perf_counter()
    try:
        fn()
        result = "ok"
    except Exception as e:  # a refusal is a figure too
        result = f"{type(e).__name__}: {e}"
    return time.perf_counter() - t0, result


def main(argv: list[str] | None = None) -> int:
    from kern.chat_formats import QWEN3
    from kern.engine.structured import GrammarBudget, Grammars
    from kern.engine.tool_calls import submit_tools
    from kern.tiny import default_model_path
    from kern.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(prog="python -m kern.bench.tool_grammars", description=__doc__)
    ap.add_argument("--tools", type=Path, help="a JSON list of tools (default: agent_tools())")
    ap.add_argument("--tokenizer", type=Path, help="a checkpoint folder (default: tiny)")
    ap.add_argument("--timeout", type=float, default=5.0, help="the CPU budget (default 5)")
    args = ap.parse_args(argv)
    tools = load_tools(args.tools) if args.tools else agent_tools()
    tok = Tokenizer.from_dir(args.tokenizer or default_model_path())
    size = len(json.dumps([t["parameters"] for t in tools]))
    print(f"{len(tools)} tools, {size} bytes of parameter schemas; budget {args.timeout:g} s")

    def run(label: str, fn: Any) -> None:
        before = grammars.compiles
        seconds, result = _timed(fn)
        print(f"{label:42s} {seconds:7.2f} s  {grammars.compiles - before:3d} compiles  {result}")

    grammars = Grammars(tok, tok.vocab_size, GrammarBudget(timeout=args.timeout))
    try:
        run("compiler start (json_object)", lambda: grammars.compile({"type": "json_object"}))
        for label, subset in (("whole tag, one tool", tools[:1]), ("whole tag, all", tools)):
            source = grammars.tools_source(subset, "auto", True, None, QWEN3)
            run(label, lambda s=source: grammars.submit(s).result())
        half = tools[: len(tools) // 2]
        for label, subset in (
            ("lazy auto, first half", half),
            ("lazy auto, all (the rest compile)", tools),
            ("lazy auto, all again (cached)", tools),
        ):
            run(
                label,
                lambda s=subset: submit_tools(
                    grammars, s, "auto", True, None, False, QWEN3
                ).result(),
            )
        fresh = Grammars(tok, tok.vocab_size, GrammarBudget(timeout=args.timeout))
        grammars, old = fresh, grammars
        old.close()
        run("compiler start (json_object)", lambda: grammars.compile({"type": "json_object"}))
        run(
            "lazy auto, all, nothing cached",
            lambda: submit_tools(grammars, tools, "auto", True, None, False, QWEN3).result(),
        )
    finally:
        grammars.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
