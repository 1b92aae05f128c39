"""The probe file format (``kern-probe/1``): a step's top logits as ``kern run --probe-dir``
writes them, read back by the end-to-end gate and the tests (see docs/cli.md, "Probes").

Design notes
------------
* ``logits_f32_bits`` is the authoritative value: each logit's IEEE-754 float32 bit pattern as
  an unsigned integer, so two runs compare bit for bit and a divergence is measured in ULPs
  (:func:`probe_ulps`). ``logits`` repeats them as decimals for people; a float32 converted to
  a Python float and printed by ``json`` is its exact value, so nothing is rounded.
* A probe records how it was made (rows, threads, device, dtype): a probe is only compared
  with one made the same way.
* numpy is imported inside the functions: the CLI imports this module, and ``kern --help``
  answers before any numerics load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["PROBE_FORMAT", "RunInfo", "probe_ulps", "read_probe", "write_probe"]

PROBE_FORMAT = "kern-probe/1"


class RunInfo(TypedDict):
    """How the probed run was made, written into every probe in this order."""

    rows: int
    threads: int
    device: str
    dtype: str
    prompt_len: int


def write_probe(
    file: Path,
    label: str,
    step: int,
    token_id: int,
    values: Tensor,
    top_ids: Tensor,
    run_info: RunInfo,
) -> None:
    """Write step ``step``'s probe (its top logits ``values``, descending, and their token
    ids ``top_ids``) to ``file``, one JSON line."""
    import numpy as np

    f32 = np.ascontiguousarray(values.detach().cpu().float().numpy(), dtype=np.float32)
    probe = {
        "format": PROBE_FORMAT,
        "label": label,
        "step": step,
        # The sequence position whose logits these are: the last token the model had read.
        "position": run_info["prompt_len"] + step - 1,
        "token_id": token_id,
        **run_info,
        "ids": [int(i) for i in top_ids.tolist()],
        "logits_f32_bits": [int(b) for b in f32.view(np.uint32).tolist()],
        "logits": [float(x) for x in f32.tolist()],
    }
    file.write_text(json.dumps(probe) + "\n", encoding="utf-8")


def read_probe(file: str | Path) -> dict[str, Any]:
    """A probe file as written by ``kern run --probe-dir``, with ``logits`` rebuilt from the
    bits (exact float32 values) and a ``by_id`` map of token id -> bit pattern. Raises
    ``ValueError`` for a file of another format."""
    probe = json.loads(Path(file).read_text(encoding="utf-8"))
    if probe.get("format") != PROBE_FORMAT:
        raise ValueError(f"{file}: not a {PROBE_FORMAT} file")
    import numpy as np

    bits = np.asarray(probe["logits_f32_bits"], dtype=np.uint32)
    probe["logits"] = bits.view(np.float32).tolist()
    probe["by_id"] = dict(zip(probe["ids"], probe["logits_f32_bits"], strict=True))
    return probe


def probe_ulps(a_bits: int, b_bits: int) -> int:
    """Distance in float32 ULPs between two float32 bit patterns (0 for +0 and -0)."""

    def ordered(u: int) -> int:
        return u & 0x7FFFFFFF if u < 0x80000000 else -(u & 0x7FFFFFFF)

    return abs(ordered(a_bits) - ordered(b_bits))
