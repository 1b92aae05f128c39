"""The published wheel, checked as a user gets it: its tags and files, then ``pip install`` into a
fresh venv with no package index and serving the embedded model from there.

Usage: .venv/bin/python scripts/check_wheel.py WHEEL (scripts/test runs it)

The fresh venv starts with the wheel's dependencies already installed (hard links of the
project venv's copies, only those that kern's own metadata asks for, so a missing
``Requires-Dist`` fails here): the situation of a GPU machine that comes with its torch and has
no network. ``pip install --no-index`` then has to find every requirement satisfied.
"""

from __future__ import annotations

import email.parser
import importlib.metadata as md
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import venv
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SHIPPED = (
    "kern/_pool.pyi",
    "kern/py.typed",
    "kern/kernels/__init__.py",
    "kern/assets/tiny-qwen3/config.json",
    "kern/assets/tiny-qwen3/model.safetensors",
    "kern/assets/tiny-qwen3/tokenizer.json",
)


def check_contents(wheel: Path) -> list[str]:
    """The wheel's tag and files; returns its Requires-Dist lines."""
    tag = re.search(r"-cp311-abi3-(manylinux_2_\d+_x86_64)\.whl$", wheel.name)
    assert tag, f"{wheel.name}: not an abi3 manylinux wheel"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for shipped in SHIPPED:
            assert shipped in names, f"{wheel.name} lacks {shipped}"
        assert any(re.fullmatch(r"kern/_pool\.abi3\.so", n) for n in names), "no kern/_pool"
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
    return meta.get_all("Requires-Dist") or []


def closure(requires: list[str]) -> list[md.Distribution]:
    """The installed distributions those requirements need, transitively, with the extras
    each one is asked for (``cuda-toolkit[cublas,...]`` by torch)."""
    dists: dict[str, md.Distribution] = {}
    extras: dict[str, set[str]] = {}
    todo = [(r, "") for r in requires]
    while todo:
        text, extra = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        wanted = {""} | set(req.extras)
        if name in dists and wanted <= extras[name]:
            continue
        dist = dists.get(name) or md.distribution(req.name)
        assert dist.version in req.specifier, f"{req}: the project venv has {dist.version}"
        dists[name] = dist
        new = wanted - extras.get(name, set())
        extras[name] = extras.get(name, set()) | wanted
        todo += [(r, e) for r in dist.requires or [] for e in new]
    return list(dists.values())


def link(dists: list[md.Distribution], site: Path) -> int:
    """Hard-link (or copy, across devices) each distribution's files into ``site``."""
    n = 0
    for dist in dists:
        root = Path(dist.locate_file(""))
        for rel in dist.files or []:
            src = root / rel
            dst = (site / rel).resolve()
            if not dst.is_relative_to(site) or not src.is_file():
                continue  # console scripts live outside site-packages: not needed here
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
            n += 1
    return n


def serve_and_ask(venv_dir: Path, work: Path) -> str:
    """``kern serve`` from the venv on a free port: one completion, one scrape, ``kern bench``
    (its HTTP client comes with the plain install), SIGTERM."""
    proc = subprocess.Popen(
        [str(venv_dir / "bin" / "kern"), "serve", "--port", "0"],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"listening on (http://\S+)", line):
                url = m.group(1)
                break
        else:
            raise AssertionError(f"no start-up line in 120 s:\n{''.join(lines)}")
        assert "serving 'tiny-qwen3'" in lines[-1], "".join(lines)
        body = b'{"model": "tiny-qwen3", "prompt": "Hello", "max_tokens": 4, "temperature": 0}'
        req = urllib.request.Request(
            url + "/v1/completions", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = r.read().decode()
        assert '"finish_reason"' in answer, answer
        with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
            assert 'kern_generation_tokens_total{model_name="tiny-qwen3"}' in r.read().decode()
        bench = [str(venv_dir / "bin" / "kern"), "bench", "--url", url, "--concurrency", "2"]
        bench += ["--requests", "2", "--prompt-tokens", "8", "--shared-prefix", "4"]
        out = subprocess.run(
            [*bench, "--max-tokens", "4"], cwd=work, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert re.search(r"Successful requests:\s+2\n", out.stdout), out.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, f"kern serve exited {proc.returncode}"
        return answer
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    wheel = Path(sys.argv[1]).resolve()
    requires = check_contents(wheel)
    # Beside the project venv (in the ignored target/), so the links stay on one device.
    scratch = Path(sys.prefix).parent / "target"
    scratch.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        venv_dir = Path(tmp) / "venv"
        venv.create(venv_dir, with_pip=True)
        purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        pure = subprocess.check_output(
            [str(venv_dir / "bin" / "python"), "-c", purelib], text=True
        ).strip()
        site = Path(pure).resolve()
        dists = closure(requires)
        n = link(dists, site)
        print(f"fresh venv: {len(dists)} dependencies pre-installed ({n} files linked)")
        pip = [str(venv_dir / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--no-index", "--no-cache-dir", str(wheel)], check=True)
        work = Path(tmp) / "work"  # away from the source tree
        work.mkdir()
        where = subprocess.check_output(
            [str(venv_dir / "bin" / "python"), "-c", "import kern; print(kern.__file__)"],
            cwd=work,
            text=True,
        ).strip()
        assert Path(where).is_relative_to(site), f"kern imported from {where}"
        answer = serve_and_ask(venv_dir, work)
        print(f"wheel ok: {wheel.name} installed offline into a fresh venv, served: {answer}")


if __name__ == "__main__":
    main()
