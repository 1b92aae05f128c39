"""The ``kern`` command: make-tiny, run, test, serve, bench (see docs/cli.md).

Design notes
------------
* One module per subcommand (``make_tiny``, ``run``, ``selfcheck`` for ``kern test``,
  ``serve``, ``bench``), each with its ``add_parser`` and the function it runs; this module
  holds only :func:`main` and the parser. The subcommands share the argument types of
  :mod:`kern.cli.args` (a leaf) and never import this module, so the package has no circle.
* Exit codes: 0 success; 1 a check failed (``kern test``) or an internal error (traceback);
  2 the command line, the config file or the checkpoint it names is wrong, with one line on
  stderr that names the flag, key or file. A user's mistake never prints a traceback.
* Torch's intra-op thread count is pinned before anything runs and printed with every result:
  CPU float32 results can differ between 1 and 2 threads (docs/invariance.md), so an answer is only
  comparable with one computed at the same count. The default is fixed
  (:data:`~kern.kern_toml.DEFAULT_THREADS`), not the machine's core count.
* Heavy imports (torch, the runner, the app) happen inside the commands, so ``kern --help``
  and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from kern import __version__
from kern.checkpoint.errors import CheckpointError
from kern.cli import bench, make_tiny, run, selfcheck, serve
from kern.errors import UsageError
from kern.kern_toml import TomlConfigError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, CheckpointError, TomlConfigError) as e:
        print(f"kern {args.command}: error: {e}", file=sys.stderr)
        return 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``kern serve: error: argument --port: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kern", description="kern: an LLM inference server (see docs/cli.md)")
    parser.add_argument("--version", action="version", version=f"kern {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (make_tiny, run, selfcheck, serve, bench):
        command.add_parser(sub)
    return parser
