"""``kern serve``: check what to serve, bind the port, load the model, say so in one line, then
serve :class:`kern.app.App` with hypercorn until SIGTERM or SIGINT.

Design notes
------------
* In that order, so that every mistake shows before a minute of loading: the flags and the
  target are checked first (:func:`kern.engine.targets.select`, as ``kern run`` selects; no
  weights read),
  then the port is bound (a port in use is an error at once, as in vLLM, not after the load),
  then the model loads (a progress bar on a terminal), then one start-up line, then hypercorn
  serves the bound socket (handed over as ``fd://``). A mistake is one line and exit 2.
* The socket is bound but not listening while the model loads: a client is refused then, never
  left connected to a server that cannot answer yet. It listens just before the start-up line
  is logged, so a client that reads "listening on" can connect at once.
* Shutdown (kern.server.drain): the first SIGTERM or SIGINT turns new requests and ``/health``
  into 503s and lets the requests in flight finish, for ``--shutdown-timeout`` seconds at
  most (then they end with ``abort``); a second signal aborts them at once. Then hypercorn
  stops, closing idle connections at once. The process exits 0.
* Binds loopback unless told otherwise: an API without a key must not face a network by default.
* ``hypercorn kern.app:app`` serves the same app, configured from the environment
  (``kern.server.settings.Settings.from_env``), with hypercorn's own start-up and signal handling.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from kern.cli.serve_flags import add_flags
from kern.engine.targets import FLAGS, select
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.server import logs

if TYPE_CHECKING:
    from kern.app import App
    from kern.engine.load import Engine

__all__ = ["add_parser", "run"]

log = logging.getLogger("kern")

# Seconds hypercorn waits for open connections once asked to stop: every handler has ended
# by then (the drain ends them first), so this only bounds a client that keeps reading.
GRACEFUL_SECONDS = 1.0
# Connections the kernel queues before hypercorn accepts them. hypercorn's 100 overflowed at
# 256 concurrent clients (a client saw a ReadError); Linux caps it at net.core.somaxconn.
BACKLOG = 4096
# Idle keep-alive seconds: hypercorn's 5 equals httpx's (the openai client's) keepalive_expiry,
# so a client could send on a connection the server is closing ("Server disconnected").
KEEP_ALIVE_SECONDS = 10.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the OpenAI- and Anthropic-compatible API (see docs/serve.md)",
        description="Serve a checkpoint folder (--model), a kern.toml target (--config and "
        "--target) or, with neither, the embedded tiny model, over HTTP: OpenAI's "
        "/v1/chat/completions, /v1/completions and /v1/responses (Codex CLI, the openai "
        "Agents SDK), Anthropic's /v1/messages (Claude Code, the anthropic SDK), /v1/models, "
        "/tokenize, /detokenize, /health and /metrics. Coding agents: docs/agents.md.",
    )
    add_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kern.server.cors import parse_origins
    from kern.server.settings import check_max_model_len, read_chat_template, served_names

    logs.configure(args.log_level)
    names = served_names(args.served_model_name or [], "--served-model-name")
    origins = parse_origins(args.allowed_origins or [], "--allowed-origins")
    if args.grammar_timeout == 0:
        raise UsageError(
            "--grammar-timeout 0: no grammar could compile; give the CPU seconds one may take"
        )
    selection = select(
        config=args.config,
        target=args.target,
        model=args.model,
        overrides={key: getattr(args, key) for key in FLAGS},
        rows=args.rows,
        served_name=names[0] if names else None,
        serving=True,
    )
    target = selection.target
    if args.enforce_eager and not target.device.startswith("cuda"):
        raise UsageError(
            f"--enforce-eager: device {target.device} never captures CUDA graphs "
            "(the flag applies to --device cuda)"
        )
    max_len = args.max_model_len
    if max_len is not None:
        check_max_model_len(max_len, selection.config, f"--max-model-len {max_len}")
    file = args.chat_template
    template = None if file is None else read_chat_template(file, f"--chat-template {file}")
    # The app imports the engine and torch: only once the target is known to be runnable.
    from kern.app import App
    from kern.server.settings import Settings, api_key, shutdown_timeout, unknown_fields_env

    key = api_key(args.api_key, args.api_key_file)
    if args.api_key is not None:
        log.warning(
            "--api-key is visible to every user of this machine in ps; prefer "
            "--api-key-file or KERN_API_KEY"
        )
    if args.body_timeout == 0:
        raise UsageError("--body-timeout 0: a client would have no time to send a body")
    sock = _bind(args.host, args.port)

    app = App(
        settings=Settings(
            target=target,
            api_key=key,
            body_timeout=args.body_timeout,
            shutdown_timeout=shutdown_timeout(os.environ, args.shutdown_timeout),
            log_prompts=args.log_prompts,
            stats_interval=args.stats_interval,
            max_model_len=max_len,
            chat_template=template,
            served_model_names=names,
            allowed_origins=origins,
            allow_unknown_fields=unknown_fields_env(os.environ),
            enforce_eager=args.enforce_eager,
        )
    )
    try:
        with _interrupts_raise():
            engine = app.start()
            graphs = f"; decode {app.decode_graphs}" if app.decode_graphs else ""
            summary = _summary(target, selection.config.model_type, engine, app, sock, graphs)
            _serve(app, sock, args, summary)
    except KeyboardInterrupt:
        log.info("stopped before serving")
    else:
        log.info("stopped")
    # Everything is closed; what interpreter teardown would add is torch's own (about 0.9 s
    # measured here, most of the 2 s a stop may take), freeing nothing a dying process needs.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _summary(
    target: Target, family: str, engine: Engine, app: App, sock: socket.socket, graphs: str = ""
) -> str:
    from kern import __version__

    stats = engine.cache.stats()
    device_arena, host_arena = engine.arena_bytes
    mib = 2**20
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    ranks = ""
    if target.ranks > 1:
        ranks = f", {target.ranks} ranks ({target.parallel}), budgets per rank"
    assert app.settings is not None and app.scheduler is not None
    names = app.settings.served_model_names[1:]
    also = f" (also {', '.join(map(repr, names))})" if names else ""
    if app.settings.max_model_len is not None:
        ranks += f", max model len {app.settings.max_model_len}"
    return (
        f"kern {__version__} serving {target.name!r}{also}: {family} from {target.checkpoint} "
        f"on {target.device}/{target.dtype}, threads {target.threads}{ranks}, "
        f"{_rows(target)}; "
        "KV pool "
        f"{app.scheduler.max_pages} pages x {target.page_tokens} tokens, "
        f"{stats.slot_capacity} state slots ({device_arena / mib:.1f} MiB); host tier "
        f"{stats.host_pages_free} pages ({host_arena / mib:.1f} MiB){_linears(target)}{graphs}; "
        f"listening on http://{host}:{port}"
    )


def _linears(target: Target) -> str:
    """Said only when the CPU linears leave the fast path (see kern.backend.cpu)."""
    from kern.backend.cpu import onednn_rows_hold

    if target.device != "cpu" or onednn_rows_hold():
        return ""
    return "; linears in MKL tiles (this torch's oneDNN rows vary with the batch: slower)"


def _rows(target: Target) -> str:
    rows = target.decode_rows
    if rows == 1:
        return "rows 1"
    if target.draft == "mtp":
        return (
            f"rows {rows} (the last token and {rows - 1} drafts of the checkpoint's MTP layer, "
            "its pages from the same pool)"
        )
    if target.draft_checkpoint is None:
        return f"rows {rows} (the last token and {rows - 1} n-gram drafts)"
    return (
        f"rows {rows} (the last token and {rows - 1} drafts of {target.draft_checkpoint}, its "
        "pages from the same pool)"
    )


def _serve(app: App, sock: socket.socket, args: argparse.Namespace, summary: str) -> None:
    import asyncio

    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.graceful_timeout = GRACEFUL_SECONDS
    config.backlog = BACKLOG
    config.keep_alive_timeout = KEEP_ALIVE_SECONDS
    error_log = logging.getLogger("hypercorn.error")
    # Its "Running on" line says less than the start-up line above; warnings still show.
    error_log.setLevel(logging.DEBUG if args.log_level == "debug" else logging.WARNING)
    config.errorlog = error_log
    if args.access_log:
        access_log = logging.getLogger("hypercorn.access")
        access_log.setLevel(logging.INFO)
        config.accesslog = access_log
    else:
        config.accesslog = None
    for name in ("hypercorn.error", "hypercorn.access"):
        logging.getLogger(name).handlers[:] = logging.getLogger("kern").handlers
        logging.getLogger(name).propagate = False

    async def main() -> None:
        from kern.server.drain import Drain

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        assert app.settings is not None and app.openai is not None and app.scheduler is not None
        timeout = app.settings.shutdown_timeout
        drain = Drain(app.admission, app.openai.runs, app.scheduler, timeout, stop)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, drain.on_signal, sig)
        # Listening from here (a client that connects now waits in the backlog for hypercorn
        # to accept), and a signal drains: only now is the start-up line true.
        sock.listen(config.backlog)
        log.info("%s", summary)
        # hypercorn takes the socket over (and closes it when it stops).
        config.bind = [f"fd://{sock.detach()}"]
        await serve(app, config, shutdown_trigger=stop.wait)

    asyncio.run(main())


class _interrupts_raise:
    """Until the event loop handles signals, SIGTERM stops the start like SIGINT does:
    quietly, exit 0."""

    def __enter__(self) -> None:
        self.previous = signal.signal(signal.SIGTERM, _raise_interrupt)

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self.previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not listening yet); ``UsageError`` naming the flag."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"--port {port}: {host}:{port} is already in use") from None
        raise UsageError(f"--host {host} --port {port}: cannot bind: {e.strerror}") from None
    return sock
