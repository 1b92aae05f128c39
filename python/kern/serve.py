"""``kern serve``: hypercorn on :data:`kern.app.app`.

The command sets the environment variables the app reads (``KERN_CONFIG``, ``KERN_TARGET``,
``KERN_API_KEY``), so ``kern serve`` and ``hypercorn kern.app:app`` configure it one way.
Binds loopback unless told otherwise: an API without a key must not face a network by default.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible API (see docs/serve.md)",
        description="Serve a kern.toml target (or, with no --config, the embedded tiny model) "
        "over the OpenAI-compatible HTTP API.",
    )
    p.add_argument("--config", type=Path, metavar="FILE", help="a kern.toml (with --target)")
    p.add_argument("--target", metavar="NAME", help="the [targets.NAME] of --config")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY'")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kern.errors import UsageError
    from kern.toml_config import load_toml_config

    if args.config is not None:
        if args.target is None:
            raise UsageError("--config needs --target NAME")
        try:
            load_toml_config(args.config).target(args.target)  # fail here, before binding
        except FileNotFoundError:
            raise UsageError(f"{args.config}: no such file") from None
        os.environ["KERN_CONFIG"] = str(args.config.resolve())
        os.environ["KERN_TARGET"] = args.target
    elif args.target is not None:
        raise UsageError("--target needs --config FILE")
    if args.api_key:
        os.environ["KERN_API_KEY"] = args.api_key

    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from kern.app import app

    config = Config()
    host = f"[{args.host}]" if ":" in args.host else args.host
    config.bind = [f"{host}:{args.port}"]
    config.accesslog = None
    config.startup_timeout = 600  # loading a large checkpoint takes a while
    shutdown = asyncio.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, shutdown.set)
        await serve(app, config, shutdown_trigger=shutdown.wait)

    asyncio.run(main())
    return 0
