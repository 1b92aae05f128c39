"""The families' registry (kern.models.registry): every row's lazily named parts load and fit
together, the config.json model types read back as their family, and the capabilities the
centres ask for are what each family's tests exercise."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kern.backend import make_ops
from kern.checkpoint.config import load_config
from kern.checkpoint.load import load_checkpoint
from kern.models import registry
from kern.models.pages import PageKind, Pages
from kern.tiny import make_tiny


def test_names_and_model_types():
    assert registry.NAMES == tuple(f.name for f in registry.FAMILIES)
    assert len(set(registry.NAMES)) == len(registry.NAMES) >= 6
    for family in registry.FAMILIES:
        assert registry.family(family.name) is family
        for model_type in family.model_types:
            assert registry.by_model_type(model_type) is family
        assert set(family.text_config) <= set(family.model_types)
    assert registry.model_types() == sorted(t for f in registry.FAMILIES for t in f.model_types)
    assert registry.by_model_type("llama") is None and registry.by_model_type(3) is None
    with pytest.raises(KeyError):
        registry.family("llama")


def test_capabilities_use_known_values():
    splits = {registry.HEADS, registry.EXPERTS, registry.EXPERTS_ONLY}
    for family in registry.FAMILIES:
        assert set(family.parallel) <= {"tp", "ep"}
        assert set(family.parallel.values()) <= splits
    assert registry.splitting("tp") == ("qwen3", "qwen3_5", "qwen3_moe")
    assert registry.with_mtp() == ("deepseek_v3",)
    assert registry.with_fp4() == ("gpt_oss", "deepseek_v4")


@pytest.mark.parametrize("name", registry.NAMES)
def test_every_row_builds_its_family(name, tmp_path):
    """make-tiny writes the family (its tiny writer), config.json reads back as it, and its
    model, page kind and tensors fit the checkpoint."""
    family = registry.family(name)
    writer = family.tiny_writer()
    assert isinstance(writer.DEFAULTS, dict) and callable(writer.config_json)
    folder = make_tiny(name, tmp_path / name, seed=2)
    config = load_config(folder)
    assert registry.of(config) is family and config.model_type == name
    kind = family.page_kind()
    assert issubclass(kind, PageKind)
    pages = kind.of(config, torch.float32, 16)
    assert kind.fit(config, 16) is None
    arena = torch.zeros(2, *pages.page_shape)
    # A kind with window pages (deepseek_v4's, gpt_oss's) binds them too: two, as the arena's slots.
    windows = torch.zeros(2, pages.window_bytes, dtype=torch.uint8) if pages.window_tokens else None
    bound = pages.bind(arena, arena.view(2, -1).view(torch.uint8), None, windows)
    assert isinstance(bound, Pages)
    assert bound.window_tokens == pages.window_tokens == kind.windowed(config) * pages.window_tokens
    shapes = family.tensor_shapes(config)
    if not config.tie_word_embeddings:
        assert family.head in shapes
    ckpt = load_checkpoint(folder)
    model = family.build_model(make_ops("cpu"), config, ckpt.tensors)
    assert len(model.layers) == config.num_hidden_layers


def test_reading_a_config_imports_no_torch(tmp_path):
    """The registry, the config readers and the tensor tables are torch-free: a server checks
    a checkpoint's config.json before anything heavy loads."""
    folder = make_tiny("deepseek_v4", tmp_path / "v4", seed=2)
    code = (
        "import sys\n"
        "from kern.checkpoint.config import load_config\n"
        "from kern.checkpoint.names import expected_shapes\n"
        f"c = load_config({str(folder)!r})\n"
        "assert expected_shapes(c)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
