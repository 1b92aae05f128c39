"""The request fields coding agents send (Claude Code on ``/v1/messages``, Codex CLI on
``/v1/responses``), against a real ``kern serve``: each is implemented or refused by name;
the unknown-field switch (``--allow-unknown-fields``) turns every POST route's 400 for an
unknown field, nested ones too, into a warning naming it; hosted tools are refused by name
unless ``--hosted-tools drop``. Helpers without a server (the system-message fold, context
management's edits, namespace tools, the cut tool call) are tested directly."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from support.server import MODEL, Server

from kern.chat_formats import QWEN3
from kern.server import api
from kern.server.anthropic_context import CLEARED, ContextManagement, apply_edits
from kern.server.anthropic_messages import _fold_system
from kern.server.openai_responses import Tools, _messages
from kern.server.openai_responses_types import ResponsesRequest
from kern.server.splitter import Splitter
from kern.tiny import default_model_path

ASK = [{"role": "user", "content": "Hello there"}]
SWITCH = "--allow-unknown-fields"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(
        tmp_path_factory.mktemp("fields"), "fields", pool_bytes="16MiB", model=default_model_path()
    )
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def lenient(tmp_path_factory):
    srv = Server(
        tmp_path_factory.mktemp("lenient"),
        "lenient",
        pool_bytes="16MiB",
        model=default_model_path(),
        extra=(SWITCH, "--hosted-tools", "drop"),
    )
    yield srv
    srv.close()


def _messages_body(**kw):
    return {"model": MODEL, "max_tokens": 3, "messages": ASK, **kw}


# Every POST route, with a body it serves and where an unknown field may go (top level and
# nested in a struct the route checks).
ROUTES = [
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 2}, None),
    ("/tokenize", {"model": MODEL, "prompt": "Hi"}, None),
    ("/detokenize", {"model": MODEL, "tokens": [1, 2]}, None),
    ("/v1/messages", _messages_body(), ("messages", 0)),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": ASK}, ("messages", 0)),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
     ("reasoning", None)),
]  # fmt: skip


def _with_unknown(body, nested):
    out = json.loads(json.dumps(body))
    out["zzz_top"] = 1
    if nested is not None:
        key, index = nested
        if index is None:
            out[key] = {"zzz_inner": True}
        else:
            out[key][index]["zzz_inner"] = True
    return out


@pytest.mark.parametrize(("path", "body", "nested"), ROUTES)
def test_unknown_fields_are_refused_by_name_with_the_switch_named(server, path, body, nested):
    r = server.http.post(path, json=_with_unknown(body, nested))
    assert r.status_code == 400, r.text
    text = r.text
    assert "zzz_top" in text and SWITCH in text and "KERN_ALLOW_UNKNOWN_FIELDS" in text, text
    if nested is not None:
        assert "zzz_inner" in text, text
    if not path.startswith("/v1/messages"):
        err = r.json()["error"]
        assert err["code"] == "unknown_parameter", err
        assert err["param"] == "zzz_top" or err["param"].endswith("zzz_inner"), err


@pytest.mark.parametrize(("path", "body", "nested"), ROUTES)
def test_the_switch_drops_unknown_fields_with_a_warning(lenient, path, body, nested):
    before = lenient.output().count("dropped unknown field")
    r = lenient.http.post(path, json=_with_unknown(body, nested))
    assert r.status_code == 200, r.text
    log = lenient.output()
    assert log.count("dropped unknown field") == before + 1
    line = log.rsplit("dropped unknown field", 1)[1].splitlines()[0]
    assert "zzz_top" in line and (nested is None or "zzz_inner" in line), line


def test_a_responses_unknown_field_names_itself(server):
    r = server.http.post("/v1/responses", json={"model": MODEL, "input": "x", "nope": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "nope" and err["code"] == "unknown_parameter"


# --- Claude Code's fields on /v1/messages -------------------------------------------------


def test_claude_codes_request_shape_is_served(server):
    """The fields Claude Code 2.1 sends on its first request, together, streamed."""
    body = _messages_body(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Fix the bug"}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /x"}]},
        ],
        system=[{"type": "text", "text": "You are an agent.",
                 "cache_control": {"type": "ephemeral"}}],
        tools=[
            {"name": "Read", "description": "Read a file",
             "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                              "required": ["file_path"]}},
            {"name": "Later", "description": "deferred", "defer_loading": True,
             "input_schema": {"type": "object", "properties": {}}},
        ],
        thinking={"type": "adaptive", "display": "omitted"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        metadata={"user_id": "{\"session_id\": \"s\"}"},
        stream=True,
    )  # fmt: skip
    headers = {
        "anthropic-beta": "claude-code-20250219,context-management-2025-06-27,effort-2025-11-24,"
        "no-such-beta-2030-01-01",
        "anthropic-version": "2023-06-01",
    }
    r = server.http.post("/v1/messages?beta=true", json=body, headers=headers)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["context_management"] == {"applied_edits": []}
    # Without a reasoning parser, adaptive thinking answers without thinking.
    assert all(e.get("content_block", {}).get("type") != "thinking" for e in events)


def test_a_mid_conversation_system_message_renders_as_a_system_turn(server):
    """Qwen3's template renders it: the prompt has it as a system turn."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "system", "content": "ENVIRONMENT-MARK"},
        ],
    }
    plain = server.http.post("/v1/messages/count_tokens", json=body)
    assert plain.status_code == 200, plain.text
    chat = server.http.post(
        "/tokenize",
        json={
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "system", "content": "ENVIRONMENT-MARK"},
            ],
        },
    )
    assert plain.json()["input_tokens"] == chat.json()["count"]


def test_system_messages_fold_where_the_template_cannot_render_them():
    def msgs(*roles):
        return [api.ChatMessage(role=r, content=f"{r}{i}") for i, r in enumerate(roles)]

    kept = msgs("user", "system")
    _fold_system(kept, renders=True)
    assert [m.role for m in kept] == ["user", "system"]
    after = msgs("system", "user", "system", "user")
    _fold_system(after, renders=False)
    assert [(m.role, m.content) for m in after] == [
        ("system", "system0"),
        ("user", "user1"),
        ("user", "system2\n\nuser3"),
    ]
    last = msgs("user", "system")
    _fold_system(last, renders=False)
    assert [(m.role, m.content) for m in last] == [("user", "user0\n\nsystem1")]
    lead = msgs("system", "system", "user")
    _fold_system(lead, renders=False)
    assert [(m.role, m.content) for m in lead] == [
        ("system", "system0\n\nsystem1"),
        ("user", "user2"),
    ]
    with pytest.raises(api.ApiError, match="no user turn"):
        _fold_system(msgs("user", "assistant", "system", "assistant"), renders=False)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 2}}, "reasoning parser"),
        ({"thinking": {"type": "adaptive", "display": "loud"}}, "display"),
        ({"output_config": {"effort": "extreme"}}, "effort"),
        ({"context_management": {"edits": [{"type": "clear_everything"}]}}, "type"),
        ({"context_management": {"edits": [{"type": "clear_thinking_20251015",
                                            "keep": {"type": "tool_uses", "value": 1}}]}}, "keep"),
        ({"tools": [{"name": "x", "input_schema": {"type": "object"}, "zzz": 1}]}, "tools[0].zzz"),
    ],
)  # fmt: skip
def test_claude_code_fields_are_checked(server, fields, says):
    r = server.http.post("/v1/messages", json=_messages_body(**fields))
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"], r.text


def test_thinking_adaptive_updates_and_effort_are_served(server):
    for fields in (
        {"thinking": {"type": "adaptive", "display": "updates"}},
        {"output_config": {"effort": "low"}},
        {"output_config": {"effort": "max"}},
    ):
        r = server.http.post("/v1/messages", json=_messages_body(**fields))
        assert r.status_code == 200, (fields, r.text)
        assert all(b["type"] != "thinking" for b in r.json()["content"])


def _count(messages):
    """A stand-in prompt length: the characters of the conversation."""

    async def count(ms):
        return sum(len(m.text()) + len(m.reasoning_content or "") for m in ms) + sum(
            len(c.function.arguments) for m in ms for c in m.tool_calls or ()
        )

    return count


def _conversation(uses: int) -> list[api.ChatMessage]:
    out = [api.ChatMessage(role="user", content="start")]
    for i in range(uses):
        call = api.MessageToolCall(
            id=f"c{i}",
            type="function",
            function=api.CalledFunction(name="Grep" if i == 0 else "Read", arguments='{"p": 1}'),
        )
        out.append(
            api.ChatMessage(
                role="assistant", content="", tool_calls=[call], reasoning_content="t" * 10
            )
        )
        out.append(api.ChatMessage(role="tool", content="x" * 100, tool_call_id=f"c{i}"))
    return out


def _edits(*edits):
    return api.decode(json.dumps({"edits": list(edits)}).encode(), ContextManagement)


def test_context_management_clears_tool_results_and_thinking():
    msgs = _conversation(5)
    cm = _edits(
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}},
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 3},
         "keep": {"type": "tool_uses", "value": 2}, "exclude_tools": ["Grep"],
         "clear_tool_inputs": ["Read"]},
    )  # fmt: skip
    out = asyncio.run(apply_edits(cm, msgs, _count(msgs)))
    thinking, tools = out["applied_edits"]
    assert thinking == {
        "type": "clear_thinking_20251015",
        "cleared_thinking_turns": 3,
        "cleared_input_tokens": 30,
    }
    # Uses 0-2 are older than the last 2; Grep (use 0) is excluded.
    assert tools["type"] == "clear_tool_uses_20250919" and tools["cleared_tool_uses"] == 2
    results = [m.content for m in msgs if m.role == "tool"]
    assert results == ["x" * 100, CLEARED, CLEARED, "x" * 100, "x" * 100]
    args = [m.tool_calls[0].function.arguments for m in msgs if m.role == "assistant"]
    assert args == ['{"p": 1}', "{}", "{}", '{"p": 1}', '{"p": 1}']
    assert tools["cleared_input_tokens"] == 2 * (100 - len(CLEARED)) + 2 * (len('{"p": 1}') - 2)


def test_context_management_leaves_what_it_need_not_clear():
    msgs = _conversation(4)
    before = [(m.content, m.reasoning_content) for m in msgs]
    cm = _edits(
        {"type": "clear_thinking_20251015", "keep": "all"},
        # Under the default trigger (100,000 input tokens): nothing cleared.
        {"type": "clear_tool_uses_20250919"},
        # Over its trigger, but clearing less than clear_at_least: not applied.
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1},
         "keep": {"type": "tool_uses", "value": 3},
         "clear_at_least": {"type": "input_tokens", "value": 10_000}},
    )  # fmt: skip
    assert asyncio.run(apply_edits(cm, msgs, _count(msgs))) == {"applied_edits": []}
    assert [(m.content, m.reasoning_content) for m in msgs] == before


def test_context_management_is_reported_by_the_server(server):
    use = {"type": "tool_use", "id": "t0", "name": "Read", "input": {"file_path": "a"}}
    result = {"type": "tool_result", "tool_use_id": "t0", "content": "abc " * 200}
    turns = [
        {"role": "user", "content": "Look"},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]
    tools = [{"name": "Read", "input_schema": {"type": "object"}}]
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 0},
            "keep": {"type": "tool_uses", "value": 0}}  # fmt: skip
    body = {"model": MODEL, "messages": turns, "tools": tools,
            "context_management": {"edits": [edit]}}  # fmt: skip
    counted = server.http.post("/v1/messages/count_tokens", json=body).json()
    assert counted["context_management"]["original_input_tokens"] > 0
    r = server.http.post("/v1/messages", json={**body, "max_tokens": 2})
    assert r.status_code == 200, r.text
    (applied,) = r.json()["context_management"]["applied_edits"]
    assert applied["type"] == "clear_tool_uses_20250919" and applied["cleared_tool_uses"] == 1
    assert applied["cleared_input_tokens"] > 100


# --- Codex CLI's fields on /v1/responses ----------------------------------------------------

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "run", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [
        {"type": "function", "name": "close_agent", "description": "close",
         "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}]},
]  # fmt: skip


def _codex_body(**kw):
    return {
        "model": MODEL,
        "input": [{"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "sess-1",
        "client_metadata": {"session_id": "sess-1", "thread_id": "th-1"},
        "max_output_tokens": 3,
        **kw,
    }  # fmt: skip


def test_codex_request_shape_is_served(server):
    r = server.http.post("/v1/responses", json=_codex_body())
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["client_metadata"] == {"session_id": "sess-1", "thread_id": "th-1"}
    assert out["store"] is False
    stream = server.http.post("/v1/responses", json=_codex_body(stream=True))
    assert stream.status_code == 200 and "response.completed" in stream.text


def test_hosted_tools_are_refused_by_name_or_dropped_with_a_warning(server, lenient):
    body = _codex_body(tools=[*CODEX_TOOLS, {"type": "web_search", "external_web_access": False}])
    r = server.http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "web_search" in err["message"] and "--hosted-tools drop" in err["message"]
    assert err["param"] == "tools[2].type"
    r = lenient.http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert "served without the hosted tools tools[2] (web_search)" in lenient.output()


def test_namespace_tools_flatten_and_come_back_named_as_declared():
    handlers = SimpleNamespace(hosted_tools="refuse", allow_unknown_fields=False)
    req = api.decode(json.dumps(_codex_body()).encode(), ResponsesRequest)
    tools = Tools(handlers, req)  # type: ignore[arg-type]
    assert [t.function.name for t in tools.functions] == [
        "exec_command",
        "multi_agent_v1.close_agent",
    ]
    assert tools.namespaced == {"multi_agent_v1.close_agent": ("multi_agent_v1", "close_agent")}
    # A call of it in a later request's input is the flattened name again.
    items = [{"type": "function_call", "call_id": "c1", "name": "close_agent",
              "namespace": "multi_agent_v1", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]  # fmt: skip
    history = _messages(items)
    assert history[0].tool_calls[0].function.name == "multi_agent_v1.close_agent"


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"max_output_tokens": 10**6}, "max_output_tokens", "max_output_tokens"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary", "summary"),
        ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f",
                     "zzz": 1}]}]}, "tools[0].tools[0].zzz", "zzz"),
    ],
)  # fmt: skip
def test_responses_errors_name_what_the_client_sent(server, fields, param, says):
    r = server.http.post("/v1/responses", json=_codex_body(**fields))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert "max_tokens" not in err["message"] and "messages" not in err["message"], err


# --- the smaller faults ----------------------------------------------------------------------


def test_a_chat_image_part_says_images_are_not_supported(server):
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    r = server.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": content}]},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert "images" in err["message"] and err["param"] == "messages[0].content[0]", err


def test_a_tool_call_cut_by_max_tokens_is_not_content():
    cut = Splitter(reasoning=None, tools=QWEN3)
    parts = cut.feed('Let me look.<tool_call>\n{"name": "Read", "argu', final=True, cut=True)
    assert parts.content == "Let me look." and not parts.calls
    assert cut.cut.startswith("<tool_call>")
    # Ended by the model itself, unclosed: the text stays, verbatim (nothing is lost).
    ended = Splitter(reasoning=None, tools=QWEN3)
    parts = ended.feed('<tool_call>\n{"name"', final=True)
    assert parts.content == '<tool_call>\n{"name"'


def test_a_cut_tool_call_leaks_no_markup_over_http(server):
    tools = [{"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}}]
    body = {"model": MODEL, "messages": ASK, "tools": tools, "tool_choice": "required",
            "max_tokens": 3}  # fmt: skip
    r = server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "<tool_call>" not in (choice["message"]["content"] or "")
    msg = server.http.post(
        "/v1/messages",
        json={"model": MODEL, "max_tokens": 3, "messages": ASK, "tool_choice": {"type": "any"},
              "tools": [{"name": "Read", "input_schema": {"type": "object"}}]},
    )  # fmt: skip
    assert msg.status_code == 200, msg.text
    assert msg.json()["stop_reason"] == "max_tokens"
    assert all("<tool_call>" not in b.get("text", "") for b in msg.json()["content"])


def test_claude_codes_warm_up_probe_answers_without_the_key(server):
    """Claude Code sends HEAD /api/hello without its key as it starts (unless told not to
    with CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC): a 2xx like /health's."""
    import httpx

    assert httpx.head(server.url + "/api/hello").status_code == 200
    assert httpx.get(server.url + "/api/hello").text == "ok\n"
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_the_environment_variable_turns_the_switch_on_under_kern_serve(tmp_path):
    """KERN_ALLOW_UNKNOWN_FIELDS=1, read by kern serve as by plain hypercorn."""
    srv = Server(tmp_path, "env", pool_bytes="4MiB", model=default_model_path(),
                 env={"KERN_ALLOW_UNKNOWN_FIELDS": "1"})  # fmt: skip
    try:
        r = srv.http.post("/v1/messages", json=_messages_body(zzz_top=1))
        assert r.status_code == 200, r.text
        assert "dropped unknown field 'zzz_top'" in srv.output()
    finally:
        srv.close()
