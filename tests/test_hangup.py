"""A streaming client's hang-up under load (kern.server.hangup): the scheduler runs at most two
steps ahead of the event loop, so a hang-up is noticed and its request aborted within a few
steps whatever the load. Over HTTP/1.1 (the client closes) and HTTP/2 (h2c, the client resets
its stream and keeps the connection), beside CPU hogs started here."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
from support.server import KEY, MODEL

from kern.server.hangup import StepGate

# Long enough that no stall of this process lets it finish before the hang-up (~10 s here).
MAX_TOKENS = 8000
BODY = {"model": MODEL, "prompt": "hang up", "max_tokens": MAX_TOKENS, "stream": True}
BODY.update(temperature=0, ignore_eos=True)


@pytest.fixture
def hogs():
    """A spinning process per core, and one more: the machine is busy while the test runs.
    Started with exec, not forked: a forked child would inherit this process's pooled client
    sockets, and a socket a child still holds sends no FIN when the test closes it (a hang-up
    the server cannot see, which is how a first version of this test failed)."""
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range((os.cpu_count() or 1) + 1)]
    yield
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("hangup", pool_bytes="16MiB")


def _aborted_and_idle(srv, before: dict, timeout: float = 60.0) -> dict:
    """Wait for the abort to land (a condition, not a time) and the request to be freed."""
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if m["kern_aborted_total"] > before["kern_aborted_total"] and (
            m["kern_num_requests_running"] == 0
        ):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.02)


def _check(srv, before: dict, at_hangup: float) -> None:
    m = _aborted_and_idle(srv, before)
    assert m["kern_aborted_total"] == before["kern_aborted_total"] + 1
    made = m["kern_generation_tokens_total"] - before["kern_generation_tokens_total"]
    after = m["kern_generation_tokens_total"] - at_hangup
    print(f"{made:.0f} tokens made, {after:.0f} of them after the hang-up was sent")
    assert made < MAX_TOKENS
    srv.assert_no_leak()


def test_gate_holds_the_scheduler_two_steps_ahead():
    # A loop that is busy (held by a threading.Event) and a "scheduler" thread delivering:
    # it gets two deliveries ahead, then waits until the loop dispatches one.
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    held, dispatched, delivered = threading.Event(), [], []
    loop.call_soon_threadsafe(held.wait)
    gate = StepGate()

    def scheduler() -> None:
        for step in range(5):
            gate.deliver(loop, dispatched.append, step)
            delivered.append(step)

    t = threading.Thread(target=scheduler, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while len(delivered) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t.join(0.3)
    assert t.is_alive() and delivered == [0, 1] and gate.pending == 2 and dispatched == []
    held.set()
    t.join(10)
    while len(dispatched) < 5:  # the last delivery returns before the loop dispatches it
        assert time.monotonic() < deadline + 10
        time.sleep(0.01)
    assert dispatched == delivered == [0, 1, 2, 3, 4] and gate.pending == 0
    loop.call_soon_threadsafe(loop.stop)
    # A stopped loop never holds the thread (shutdown and the crash path deliver too).
    deadline = time.monotonic() + 10
    while loop.is_running():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.deliver(loop, dispatched.append, 5)
    gate.deliver(loop, dispatched.append, 6)
    gate.deliver(loop, dispatched.append, 7)
    loop.close()
    gate.deliver(loop, dispatched.append, 8)  # closed: dropped, not raised
    assert gate.pending == 3  # three queued past the bound: the thread was never held


def test_hang_up_http1_under_load(server, hogs):
    before = server.idle_metrics()
    with server.http.stream("POST", "/v1/completions", json=BODY) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
    at_hangup = server.metrics()["kern_generation_tokens_total"]
    _check(server, before, at_hangup)


def test_rst_stream_http2_under_load(server, hogs):
    before = server.idle_metrics()
    config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    conn = h2.connection.H2Connection(config)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        conn.initiate_connection()  # prior knowledge: h2c without an upgrade
        body = json.dumps(BODY).encode()
        headers = [
            (":method", "POST"),
            (":path", "/v1/completions"),
            (":scheme", "http"),
            (":authority", f"127.0.0.1:{server.port}"),
            ("content-type", "application/json"),
            ("authorization", f"Bearer {KEY}"),
            ("content-length", str(len(body))),
        ]
        conn.send_headers(1, headers)
        conn.send_data(1, body, end_stream=True)
        s.sendall(conn.data_to_send())
        status, events = None, 0
        while events < 3:
            data = s.recv(65536)
            assert data, "the server closed the connection"
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    status = dict(ev.headers)[":status"]
                elif isinstance(ev, h2.events.DataReceived):
                    events += ev.data.count(b"data: ")
                    conn.acknowledge_received_data(ev.flow_controlled_length, 1)
            s.sendall(conn.data_to_send())
        assert status == "200"
        # The client cancels its stream; the connection stays open.
        conn.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
        s.sendall(conn.data_to_send())
        at_hangup = server.metrics()["kern_generation_tokens_total"]
        _check(server, before, at_hangup)
        # The same connection still serves: another stream, answered whole.
        small = json.dumps({"model": MODEL, "prompt": "again", "max_tokens": 2}).encode()
        conn.send_headers(3, [*headers[:-1], ("content-length", str(len(small)))])
        conn.send_data(3, small, end_stream=True)
        s.sendall(conn.data_to_send())
        answer, ended = b"", False
        while not ended:
            data = s.recv(65536)
            assert data, "the server closed the connection"
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.DataReceived) and ev.stream_id == 3:
                    answer += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, 3)
                ended |= isinstance(ev, h2.events.StreamEnded) and ev.stream_id == 3
            s.sendall(conn.data_to_send())
        assert json.loads(answer)["usage"]["completion_tokens"] == 2
