"""Run from outside the checkout with only the built wheel on the path: it must import whole."""

from pathlib import Path

import kern
import kern.kernels.paged_attention.reference  # torch comes from the venv
import kern.pool

where = Path(kern.__file__).resolve()
assert "site" in where.parts, f"kern imported from {where}, not from the installed wheel"
for shipped in ("_pool.pyi", "py.typed", "kernels/__init__.py", "assets/tiny-qwen3/config.json"):
    assert (where.parent / shipped).is_file(), f"the wheel lacks {shipped}"
assert not (where.parent / "kernels").is_symlink(), "kernels shipped as a link"
kern.pool.Cache(page_tokens=16, page_bytes=4096, device_bytes=1 << 20)
print(f"wheel ok: {where.parent}")
