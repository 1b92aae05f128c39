"""Run from outside the checkout with only the built wheel on the path: it must import whole."""

from pathlib import Path

import kern
import kern.pool

where = Path(kern.__file__).resolve()
assert "site" in where.parts, f"kern imported from {where}, not from the installed wheel"
assert (where.parent / "_pool.pyi").is_file(), "the wheel lacks the _pool.pyi stub"
assert (where.parent / "py.typed").is_file(), "the wheel lacks py.typed"
kern.pool.Cache(page_tokens=16, page_bytes=4096, device_bytes=1 << 20)
kernels = where.parent / "kernels"
if kernels.exists():
    assert (kernels / "__init__.py").is_file() and not kernels.is_symlink(), (
        "kernels not shipped whole"
    )
print(f"wheel ok: {where.parent}")
