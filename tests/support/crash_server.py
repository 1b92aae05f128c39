"""A server whose runner fails after a few forwards, for the crash test: the same app and
engine as ``kern serve``, built with a runner that raises (injected here, not in the app).

Usage: python crash_server.py PORT STEPS (the embedded model; KERN_API_KEY is honoured).
"""

from __future__ import annotations

import asyncio
import sys

from hypercorn.asyncio import serve
from hypercorn.config import Config

import kern.app
from kern.app import App
from kern.engine.load import Engine


def main() -> None:
    port, steps = int(sys.argv[1]), int(sys.argv[2])
    # Long enough for the test to see the 503 a request gets between the failure and the exit.
    kern.app.CRASH_EXIT_DELAY = 3.0

    def load_failing(target):
        engine = Engine.load(target)
        forward = engine.runner.forward
        count = [0]

        def failing(batch):
            count[0] += 1
            if count[0] > steps:
                raise RuntimeError(f"injected failure after {steps} steps")
            return forward(batch)

        engine.runner.forward = failing
        return engine

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    asyncio.run(serve(App(load_engine=load_failing), config))


if __name__ == "__main__":
    main()
