"""Fixtures shared by the suites: tiny checkpoints of every family, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.server import Server

from kern.checkpoint.load import Checkpoint, load_checkpoint
from kern.tiny import make_tiny

FAMILIES = ("qwen3", "qwen3_5", "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """``tiny_dir(family)``: the folder of a seed-1 ``make-tiny`` checkpoint of ``family``."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_tiny(family, tmp_path_factory.mktemp(family), seed=1)
        return made[family]

    return get


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """``tiny(family)``: that checkpoint, loaded (float32, CPU)."""
    loaded: dict[str, Checkpoint] = {}

    def get(family: str) -> Checkpoint:
        if family not in loaded:
            loaded[family] = load_checkpoint(tiny_dir(family))
        return loaded[family]

    return get


@pytest.fixture(scope="module")
def make_server(tmp_path_factory):
    """``make_server(name, **options)``: a :class:`support.server.Server` for this module,
    closed when the module's tests are done."""
    made: list[Server] = []

    def make(name: str, **options) -> Server:
        srv = Server(tmp_path_factory.mktemp(name), name, **options)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.close()
