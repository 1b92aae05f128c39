"""gpt-oss's harmony prompt: a chat request (OpenAI-shaped messages and tools) rendered as the
``openai-harmony`` package renders the same conversation for completion, so the model reads
what it was trained on. Torch-free; imports nothing else of kern.

Design notes
------------
* The system message is harmony's default one (the model identity, knowledge cutoff 2024-06,
  an optional current date, the reasoning effort, the valid channels, and the commentary line
  when there are function tools). The client's system and developer messages become the
  developer message's ``# Instructions`` (joined by a blank line, in order), and the tools its
  ``# Tools`` namespace ``functions``, each a TypeScript type (:func:`typescript`).
* An assistant turn is its reasoning (``reasoning_content``, ``reasoning`` or ``thinking``) on
  the ``analysis`` channel, its text on ``final`` (``commentary`` when it also calls tools: a
  preamble), and each call to ``functions.NAME`` on ``commentary`` as ``<|constrain|>json``
  ending in ``<|call|>``; a tool message is ``functions.NAME to=assistant`` on
  ``commentary``, NAME found from its ``tool_call_id`` (or its ``name``).
* As openai-harmony does by default, when the last assistant message is on ``final``, the
  ``analysis`` messages before the first ``final`` are left out.
* A tool schema becomes TypeScript as openai-harmony writes it (objects with ``//`` comments
  for titles, descriptions, examples and defaults, ``?`` for optional keys, enums as unions,
  arrays as ``T[]``, ``oneOf`` as ``|`` lines, type lists as unions, ``nullable``); defaults
  print as compact JSON. Property order is the schema's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "CALL",
    "CHANNEL",
    "CONSTRAIN",
    "END",
    "MESSAGE",
    "RETURN",
    "START",
    "render",
    "typescript",
]

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    reasoning_effort: str = "medium",
    date: str | None = None,
    add_generation_prompt: bool = True,
) -> tuple[str, list[str]]:
    """The harmony prompt of ``messages`` (dicts as chat completions sends them: ``role``,
    ``content`` text, and ``tool_calls`` / ``tool_call_id`` / ``name`` / reasoning keys) with
    function ``tools`` (``{"name", "description", "parameters"}`` each), and the client's texts
    in it in the order they appear (what the tokenizer keeps plain text). Raises
    ``ValueError`` naming what it cannot render."""
    if reasoning_effort not in EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORTS)}")
    out = [_system(reasoning_effort, date, bool(tools))]
    instructions = [
        _text(m) for m in messages if m.get("role") in ("system", "developer") and _text(m)
    ]
    joined = "\n\n".join(instructions) or None
    contents = [joined] if joined else []
    developer = _developer(joined, tools)
    if developer is not None:
        out.append(_message("developer", developer))
    turns = _turns([m for m in messages if m.get("role") not in ("system", "developer")])
    final = [i for i, (header, _, _) in enumerate(turns) if f"{CHANNEL}final" in header]
    last = next((h for h, _, _ in reversed(turns) if h.startswith("assistant")), "")
    drop_before = final[0] if final and f"{CHANNEL}final" in last else -1
    for i, (header, body, end) in enumerate(turns):
        if i < drop_before and header == f"assistant{CHANNEL}analysis":
            continue
        out.append(f"{START}{header}{MESSAGE}{body}{end}")
        contents.append(body)
    if add_generation_prompt:
        out.append(f"{START}assistant")
    return "".join(out), contents


def _message(role: str, body: str) -> str:
    return f"{START}{role}{MESSAGE}{body}{END}"


def _text(m: Mapping[str, Any]) -> str:
    content = m.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: only text can be rendered
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text"):
                raise ValueError("harmony prompts take text content parts only")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError("a message's content must be text or a list of text parts")


def _system(effort: str, date: str | None, has_tools: bool) -> str:
    top = [MODEL_IDENTITY, f"Knowledge cutoff: {KNOWLEDGE_CUTOFF}"]
    if date is not None:
        top.append(f"Current date: {date}")
    channels = (
        "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    )
    if has_tools:
        channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return _message("system", "\n\n".join(["\n".join(top), f"Reasoning: {effort}", channels]))


def _developer(instructions: str | None, tools: Sequence[Mapping[str, Any]] | None) -> str | None:
    sections = []
    if instructions is not None:
        sections += ["# Instructions", instructions]
    if tools:
        lines = ["## functions\n", "namespace functions {\n"]
        for tool in tools:
            lines += [f"// {line}" for line in str(tool.get("description") or "").splitlines()]
            params = tool.get("parameters")
            args = "" if params is None else f"_: {typescript(params, '')}"
            lines.append(f"type {tool['name']} = ({args}) => any;\n")
        lines.append("} // namespace functions")
        sections.append("# Tools\n\n" + "\n".join(lines))
    return "\n\n".join(sections) if sections else None


def _turns(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """(header, body, end marker) of each harmony message the client's messages make."""
    names: dict[str, str] = {}  # tool_call_id -> function name
    out: list[tuple[str, str, str]] = []
    for m in messages:
        role = m.get("role")
        if role == "user":
            out.append(("user", _text(m), END))
        elif role == "assistant":
            reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k)), None)
            if reasoning:
                out.append((f"assistant{CHANNEL}analysis", str(reasoning), END))
            calls = m.get("tool_calls") or []
            text = _text(m)
            if text:
                channel = "commentary" if calls else "final"
                out.append((f"assistant{CHANNEL}{channel}", text, END))
            for call in calls:
                fn = call.get("function") or {}
                name = fn.get("name")
                if not isinstance(name, str) or not name:
                    raise ValueError("an assistant tool call needs its function's name")
                if call.get("id"):
                    names[call["id"]] = name
                header = f"assistant to=functions.{name}{CHANNEL}commentary {CONSTRAIN}json"
                out.append((header, str(fn.get("arguments") or "{}"), CALL))
        elif role == "tool":
            name = names.get(m.get("tool_call_id") or "") or m.get("name")
            if not name:
                raise ValueError(
                    "a tool message needs a tool_call_id of an earlier call (or a name)"
                )
            out.append((f"functions.{name} to=assistant{CHANNEL}commentary", _text(m), END))
        else:
            raise ValueError(f"role {role!r} cannot be rendered in harmony")
    return out


def typescript(schema: Any, indent: str) -> str:
    """A JSON schema as openai-harmony's TypeScript (see the module notes)."""
    if not isinstance(schema, Mapping):
        return "any"
    one_of = schema.get("oneOf")
    if isinstance(one_of, list):
        return "".join(
            f"\n{indent} | " + _variant(v, indent) + _trailing(v, None, False, top=True)
            for v in one_of
        )
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if t == "integer" else t for t in kind if isinstance(t, str)]
        if names:
            return " | ".join(names)
        kind = None
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        values = schema.get("enum")
        if isinstance(values, list):
            shown = [f'"{v}"' for v in values if isinstance(v, str)]
            if shown:
                return " | ".join(shown)
        return "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        items = schema.get("items")
        return f"{typescript(items, indent)}[]" if items is not None else "Array<any>"
    return "any"


def _variant(v: Any, indent: str) -> str:
    text = typescript(v, indent + "   ")
    if isinstance(v, Mapping) and v.get("nullable") is True and "null" not in text:
        text += " | null"
    return text


def _is_enum(schema: Mapping[str, Any]) -> bool:
    values = schema.get("enum")
    return isinstance(values, list) and bool(values)


def _default(schema: Mapping[str, Any], top: bool = False) -> str:
    """``default: ...``: a string quoted unless the schema is an enum (a top-level oneOf
    variant's always quoted, as openai-harmony prints it there), anything else as JSON."""
    value = schema["default"]
    if isinstance(value, str) and not (top or not _is_enum(schema)):
        return f"default: {value}"
    if isinstance(value, str):
        return f'default: "{value}"'
    return "default: " + json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _trailing(v: Any, skip: str | None, skip_first: bool, top: bool = False) -> str:
    """A oneOf variant's ``// description default`` comment."""
    if not isinstance(v, Mapping):
        return ""
    notes = []
    desc = v.get("description")
    if not skip_first and isinstance(desc, str) and desc != skip:
        notes.append(desc)
    if "default" in v:
        notes.append(_default(v, top))
    return f" // {' '.join(notes)}" if notes else ""


def _object(schema: Mapping[str, Any], indent: str) -> str:
    out = []
    desc = schema.get("description")
    if isinstance(desc, str):
        out.append(f"{indent}// {desc}\n")
    out.append("{\n")
    props = schema.get("properties")
    required = schema.get("required")
    required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    for key, val in props.items() if isinstance(props, Mapping) else ():
        val = val if isinstance(val, Mapping) else {}
        mark = "" if key in required else "?"
        title = val.get("title")
        if isinstance(title, str):
            out.append(f"{indent}// {title}\n{indent}//\n")
        one_of = val.get("oneOf")
        val_desc = val.get("description")
        if not isinstance(one_of, list) and isinstance(val_desc, str):
            out.append(f"{indent}// {val_desc}\n")
        examples = val.get("examples")
        if isinstance(examples, list) and examples:
            out.append(f"{indent}// Examples:\n")
            out += [f'{indent}// - "{ex}"\n' for ex in examples if isinstance(ex, str)]
        if isinstance(one_of, list):
            out.append(_one_of_property(key, mark, val, one_of, indent))
            continue
        text = typescript(val, indent + "    ")
        if val.get("nullable") is True and "null" not in text:
            text += " | null"
        out.append(f"{indent}{key}{mark}: {text},")
        if "default" in val:
            out.append(f" // {_default(val)}")
        out.append("\n")
    out.append(f"{indent}}}")
    return "".join(out)


def _one_of_property(key: str, mark: str, val: Mapping[str, Any], one_of: list, indent: str) -> str:
    out = []
    desc = val.get("description") if isinstance(val.get("description"), str) else None
    first = one_of[0] if one_of and isinstance(one_of[0], Mapping) else {}
    above = desc is not None and first.get("description") != desc
    if above:
        out.append(f"{indent}// {desc}\n")
    if "default" in val:
        out.append(f"{indent}// {_default(val)}\n")
    out.append(f"{indent}{key}{mark}:\n")
    for i, v in enumerate(one_of):
        line = f"{indent} | " + _variant(v, indent)
        out.append(line + _trailing(v, desc, i == 0 and above) + "\n")
    out.append(f"{indent},\n")
    return "".join(out)
