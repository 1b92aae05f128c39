"""openai-harmony, the reference renderer and parser of gpt-oss's harmony format, with the real
o200k_base vocabulary it needs: no PyPI package of openai-harmony ships that file, and the
tests reach PyPI only, so it is taken from the llama-index-core wheel, which carries it as
tiktoken's cache entry (checked against openai-harmony's own sha256 before use)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
WHEEL = "llama-index-core==0.14.25"
# tiktoken's cache name for o200k_base.tiktoken: sha1 of its public URL.
MEMBER = "llama_index/core/_static/tiktoken_cache/fb374d419588a4632f3f557e76b4b70aebbca790"
CACHE = Path(os.environ.get("KERN_TEST_CACHE", Path.home() / ".cache" / "kern-tests"))


def o200k_file() -> Path:
    """The o200k_base.tiktoken file, fetched once into the test cache (one test worker at a
    time: the others wait on the lock, then find it there)."""
    out = CACHE / "o200k" / "o200k_base.tiktoken"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file() and _sha256(out) == O200K_SHA256:
            return out
        return _fetch(out)


def _fetch(out: Path) -> Path:
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), WHEEL],
        check=True,
    )
    wheel = next(wheels.glob("llama_index_core-*.whl"))
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        tmp = out.with_suffix(".part")
        tmp.write_bytes(z.read(MEMBER))
    if _sha256(tmp) != O200K_SHA256:
        raise RuntimeError(f"{wheel}: {MEMBER} is not o200k_base.tiktoken (sha256 differs)")
    tmp.replace(out)
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def encoding() -> Any:
    """openai-harmony's gpt-oss encoding over the cached vocabulary file."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(o200k_file().parent)
    import openai_harmony

    return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def conversation(messages: list[dict], tools: list[dict] | None, effort: str, date: str | None):
    """The openai-harmony conversation that ``messages`` (chat completions' shape) mean: the
    system message harmony's defaults make, the client's system/developer texts as the
    developer's instructions, tools in ``functions``, and each assistant turn's reasoning,
    text and calls on their channels (docs/gpt_oss.md)."""
    import openai_harmony as h

    system = h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort(effort.capitalize()))
    if date is not None:
        system = system.with_conversation_start_date(date)
    out = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    instructions = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    if instructions or tools:
        dev = h.DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if tools:
            dev = dev.with_function_tools(
                [
                    h.ToolDescription.new(t["name"], t.get("description", ""), t.get("parameters"))
                    for t in tools
                ]
            )
        out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, dev))
    names = {}
    for m in messages:
        if m["role"] == "user":
            out.append(h.Message.from_role_and_content(h.Role.USER, m["content"]))
        elif m["role"] == "assistant":
            if m.get("reasoning_content"):
                msg = h.Message.from_role_and_content(h.Role.ASSISTANT, m["reasoning_content"])
                out.append(msg.with_channel("analysis"))
            calls = m.get("tool_calls") or []
            if m.get("content"):
                msg = h.Message.from_role_and_content(h.Role.ASSISTANT, m["content"])
                out.append(msg.with_channel("commentary" if calls else "final"))
            for c in calls:
                names[c["id"]] = c["function"]["name"]
                msg = h.Message.from_role_and_content(h.Role.ASSISTANT, c["function"]["arguments"])
                msg = msg.with_channel("commentary").with_content_type("<|constrain|>json")
                out.append(msg.with_recipient("functions." + c["function"]["name"]))
        elif m["role"] == "tool":
            author = h.Author.new(h.Role.TOOL, "functions." + names[m["tool_call_id"]])
            msg = h.Message.from_author_and_content(author, m["content"])
            out.append(msg.with_channel("commentary").with_recipient("assistant"))
    return h.Conversation.from_messages(out)
