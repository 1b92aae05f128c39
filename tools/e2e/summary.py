"""The gate's summary: ``summary.json`` (everything) and ``summary.md`` (the target x
scenario table docs/serve.md quotes), from one run's results."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scenarios import Result

__all__ = ["TargetReport", "failed", "markdown", "write"]


@dataclass
class TargetReport:
    name: str
    family: str
    device: str
    results: list[Result] = field(default_factory=list)
    skipped: str | None = None  # why the whole target was skipped


def failed(reports: list[TargetReport]) -> list[str]:
    """The "target: scenario" of every scenario that failed its gate."""
    return [f"{t.name}: {r.scenario}" for t in reports for r in t.results if r.status == "fail"]


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def markdown(reports: list[TargetReport], head: dict[str, Any]) -> str:
    lines = [
        f"Gate of {head['date']} ({head['machine']}): {head['wall_s']:.0f} s wall, "
        f"{head['cpu_s']:.0f} s CPU in all processes.",
        "",
        f"    {head['command']}",
        "",
        "| target | scenario | result | compared | excused | cached tokens | parked | woken "
        "| wall s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in reports:
        for r in t.results:
            status = r.status if r.status != "skip" else f"skip: {t.skipped}"
            lines.append(
                f"| {t.name} | {r.scenario} | {status} | {r.compared} | {r.excused} | "
                f"{_cell(r.cached_tokens)} | {_cell(r.parked)} | {_cell(r.woken)} | "
                f"{r.wall_s:.1f} |"
            )
    excused = {t.name: sum(r.excused for r in t.results) for t in reports}
    lines += ["", "Excused divergences: " + ", ".join(f"{k} {v}" for k, v in excused.items())]
    bad = failed(reports)
    lines.append("Result: " + ("PASS" if not bad else "FAIL (" + "; ".join(bad) + ")"))
    notes = [
        f"- {t.name} / {r.scenario}: {msg}"
        for t in reports
        for r in t.results
        for msg in r.failures + r.notes
    ]
    if notes:
        lines += ["", "Notes and failures:", "", *notes]
    return "\n".join(lines) + "\n"


def write(out: Path, reports: list[TargetReport], head: dict[str, Any]) -> tuple[Path, Path]:
    data = {
        **head,
        "ok": not failed(reports),
        "failed": failed(reports),
        "targets": [
            {
                "name": t.name,
                "family": t.family,
                "device": t.device,
                "skipped": t.skipped,
                "excused": sum(r.excused for r in t.results),
                "scenarios": [dataclasses.asdict(r) for r in t.results],
            }
            for t in reports
        ],
    }
    json_file, md_file = out / "summary.json", out / "summary.md"
    json_file.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    md_file.write_text(markdown(reports, head), encoding="utf-8")
    return json_file, md_file
