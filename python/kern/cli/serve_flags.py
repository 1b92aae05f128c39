"""``kern serve``'s flags, by group: what to serve, the target's keys, the network, the logs
(kern.cli.serve runs them; docs/serve.md lists them)."""

from __future__ import annotations

import argparse
from pathlib import Path

import kern.cli.args as argtypes
from kern.chat_formats import DEFAULT, FORMATS, REASONING_PARSERS, TOOL_PARSERS
from kern.kern_toml import DEFAULT_THREADS, HOSTED_TOOLS
from kern.server import logs

__all__ = ["add_flags"]


def add_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of ``kern serve``, in its help's order."""
    _what(p)
    _target_keys(p)
    _network(p)
    _logs(p)


def _what(p: argparse.ArgumentParser) -> None:
    """What to serve, and how much of it."""
    what = p.add_argument_group("what to serve")
    what.add_argument("--model", type=Path, metavar="DIR", help="a Hugging Face checkpoint folder")
    what.add_argument("--config", type=Path, metavar="FILE", help="a kern.toml (with --target)")
    what.add_argument("--target", metavar="NAME", help="the [targets.NAME] of --config")
    what.add_argument(
        "--served-model-name",
        action="append",
        metavar="NAME",
        help="the model id clients send (default: the target's name, or the folder's name); "
        "repeat it for aliases: answers report the first",
    )
    what.add_argument(
        "--max-model-len",
        type=argtypes.positive_int,
        metavar="N",
        help="the context a request may fill, prompt and answer (default and most: the "
        "model's max_position_embeddings)",
    )
    what.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template in place of the checkpoint's",
    )


def _target_keys(p: argparse.ArgumentParser) -> None:
    """The flags that set a kern.toml key of the target."""
    keys = p.add_argument_group(
        "target keys", "each sets the kern.toml key of the same name (over --config's value)"
    )
    keys.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    keys.add_argument(
        "--device", type=argtypes.device, metavar="DEVICE", help="cpu, cuda or cuda:N"
    )
    keys.add_argument(
        "--pool-bytes",
        type=argtypes.byte_size(1),
        metavar="BYTES",
        help="device budget for KV pages and states, e.g. 512MiB (default: 256MiB on the CPU, "
        "85%% of the memory free after loading on CUDA)",
    )
    keys.add_argument(
        "--host-bytes",
        type=argtypes.byte_size(0),
        metavar="BYTES",
        help="host-memory tier for parked cache entries, e.g. 4GiB (default 0: none)",
    )
    keys.add_argument("--page-tokens", type=argtypes.positive_int, metavar="N", help="default 16")
    keys.add_argument(
        "--snapshot-pages",
        type=argtypes.positive_int,
        metavar="N",
        help="deepseek_v4: a prefill snapshot a hit resumes from every N pages (default 1)",
    )
    keys.add_argument(
        "--threads", type=argtypes.positive_int, metavar="N", help=f"default {DEFAULT_THREADS}"
    )
    keys.add_argument(
        "--ranks",
        type=argtypes.positive_int,
        metavar="N",
        help="processes that split the model, tp unless the target says (default 1)",
    )
    keys.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split chat answers' <think>...</think> into reasoning_content (default: off)",
    )
    keys.add_argument(
        "--tool-call-parser",
        dest="tool_parser",
        choices=TOOL_PARSERS,
        help="the convention chat answers write tool calls in, the kern.toml key tool_parser: "
        f"{_tool_formats()} (default: {DEFAULT.name})",
    )
    keys.add_argument(
        "--grammar-timeout",
        type=argtypes.seconds,
        metavar="SECONDS",
        help="CPU seconds a request's response_format or tools grammar may take to compile, "
        "in a process of its own; past it the compile is killed and the request gets a 400 "
        "(default 5)",
    )
    keys.add_argument(
        "--grammar-max-bytes",
        type=argtypes.byte_size(1),
        metavar="BYTES",
        help="the largest schema (as JSON) or tool list a request may ask to compile; a larger "
        "one is a 400 (default 1MiB)",
    )
    keys.add_argument(
        "--allow-unknown-fields",
        action="store_const",
        const=True,
        help="a request field kern does not know (on any POST route, nested fields too) is "
        "dropped and named in a warning instead of refused with a 400 naming it; also "
        "KERN_ALLOW_UNKNOWN_FIELDS=1 (default: refused)",
    )
    keys.add_argument(
        "--hosted-tools",
        choices=HOSTED_TOOLS,
        help="a tool only its vendor runs (the Responses API's web_search, file_search, ...): "
        "refuse names it in a 400, drop serves without it and names it in a warning "
        "(default: refuse)",
    )
    keys.add_argument(
        "--draft",
        metavar="DRAFT",
        help="the drafter at rows > 1: ngram, mtp (a deepseek_v3 checkpoint's own MTP layer) "
        "or a draft checkpoint folder (default: ngram)",
    )
    keys.add_argument(
        "--rows",
        type=argtypes.positive_int,
        metavar="R",
        help="positions a decode step verifies per sequence: the last token and R - 1 drafts "
        "(n-gram, the target's draft checkpoint or its MTP layer); one of the target's "
        "declared rows (default: its widest; 1: plain decoding)",
    )
    keys.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run decode steps op by op instead of replaying the CUDA graphs "
        "captured at start-up (refused on the CPU, which never captures)",
    )


def _network(p: argparse.ArgumentParser) -> None:
    """Where to listen, who may call, and how long a request may take to arrive or end."""
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    net.add_argument(
        "--port",
        type=argtypes.port,
        default=8000,
        help="port to bind (default 8000; 0: any free one)",
    )
    net.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (visible in ps: prefer --api-key-file or "
        "KERN_API_KEY)",
    )
    net.add_argument(
        "--api-key-file", type=Path, metavar="FILE", help="the API key, the file's first line"
    )
    net.add_argument(
        "--allowed-origins",
        action="append",
        metavar="ORIGIN[,ORIGIN...]",
        help="answer CORS preflights and let browser pages of these origins (* for any) read "
        "answers (default: none, OPTIONS is a 405)",
    )
    net.add_argument(
        "--body-timeout",
        type=argtypes.seconds,
        default=30.0,
        metavar="SECONDS",
        help="time a client has to send a request body whole (default 30)",
    )
    net.add_argument(
        "--shutdown-timeout",
        type=argtypes.seconds,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, the time requests in flight get to finish while new ones get "
        "a 503; what is left then ends with finish_reason abort (default: "
        "KERN_SHUTDOWN_TIMEOUT, else 25; a second signal stops at once)",
    )


def _logs(p: argparse.ArgumentParser) -> None:
    """What goes into the log."""
    log_args = p.add_argument_group("logs")
    log_args.add_argument("--log-level", choices=logs.LEVELS, default="info", help="default info")
    log_args.add_argument(
        "--log-prompts", action="store_true", help="put each prompt's text in its request line"
    )
    log_args.add_argument(
        "--stats-interval",
        type=argtypes.seconds,
        default=10.0,
        metavar="SECONDS",
        help="a stats line this often while busy (default 10; 0: none)",
    )
    log_args.add_argument("--access-log", action="store_true", help="hypercorn's access log too")


def _tool_formats() -> str:
    """The formats ``--tool-call-parser`` takes, as its help names them."""
    named = [f"{name}'s {f.summary}" for name, f in FORMATS.items()]
    return " or ".join([", ".join(named[:-1]), named[-1]] if len(named) > 1 else named)
