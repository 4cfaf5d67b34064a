"""A run's results as JSON: ``--json FILE`` writes them after a run, ``--from-json FILE``
reads them back to print the report and draw the chart again without measuring.

The file holds every row's figures (``report.Row``), the versions line, the notes and the
run's settings. Keys keep their order (a row's command breakdown is most called first, as
the report prints it), so two saves of one run are the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.engine import EngineFigures
from benchmarks.measure import Exactness, Footprint
from benchmarks.report import Row, render

#: What ``format`` says in a file this module writes; another value is refused.
FORMAT = "django-quota-benchmark/1"
#: The options of the run that the report prints (``report.render`` reads them).
SETTINGS = ("decisions", "rounds", "threads", "subjects", "limit", "attempts", "monitor_sample")


@dataclass
class SavedRun:
    """One run: its rows, and what its report prints around them."""

    rows: list[Row]
    header: list[str] = field(default_factory=list)
    """The versions line: python, redis-server, the peers' versions."""
    notes: list[str] = field(default_factory=list)
    settings: dict[str, int] = field(default_factory=dict)
    """The run's options named in SETTINGS (the rest of the command line is not kept)."""
    cores: int = 0
    seconds: float = 0.0
    engine: EngineFigures | None = None
    """The engine's figures (``benchmarks.engine``), when they were measured."""

    def arguments(self) -> argparse.Namespace:
        """The options as ``report.render`` reads them from the command line."""
        return argparse.Namespace(**self.settings)

    def report(self) -> str:
        """The run's printed report (``report.render``), the same measured or saved."""
        return render(
            self.rows,
            header=self.header,
            notes=self.notes,
            args=self.arguments(),
            cores=self.cores,
            seconds=self.seconds,
            figures=self.engine,
        )


def settings_of(args: argparse.Namespace) -> dict[str, int]:
    return {name: int(getattr(args, name)) for name in SETTINGS}


def to_json(run: SavedRun) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "header": list(run.header),
        "notes": list(run.notes),
        "settings": dict(run.settings),
        "cores": run.cores,
        "seconds": run.seconds,
        # asdict turns the footprints' and exactness' dataclasses into dicts as well.
        "rows": [dataclasses.asdict(row) for row in run.rows],
        "engine": None if run.engine is None else run.engine.to_json(),
    }


def _footprint(data: Mapping[str, Any]) -> Footprint:
    by_kind = {str(kind): (int(keys), int(size)) for kind, (keys, size) in data["by_kind"].items()}
    return Footprint(keys=int(data["keys"]), bytes=int(data["bytes"]), by_kind=by_kind)


def _exactness(data: Mapping[str, Any]) -> Exactness:
    return Exactness(
        admitted=int(data["admitted"]), limit=int(data["limit"]), attempts=int(data["attempts"])
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _row(data: Mapping[str, Any]) -> Row:
    exactness = data.get("exactness")
    return Row(
        key=str(data["key"]),
        reference=str(data["reference"]),
        implementation=str(data["implementation"]),
        algorithm=str(data["algorithm"]),
        median_us=float(data["median_us"]),
        p99_us=float(data["p99_us"]),
        throughput_1=float(data["throughput_1"]),
        throughput_n=float(data["throughput_n"]),
        commands=_optional_float(data.get("commands")),
        server_cpu_us=_optional_float(data.get("server_cpu_us")),
        command_breakdown={
            str(name): float(calls) for name, calls in data["command_breakdown"].items()
        },
        sent=_optional_float(data.get("sent")),
        # JSON object keys are strings: the decision counts (1, 100) become ints again.
        footprints={
            int(decisions): _footprint(footprint)
            for decisions, footprint in data.get("footprints", {}).items()
        },
        exactness=None if exactness is None else _exactness(exactness),
        base=None if data.get("base") is None else str(data["base"]),
    )


def from_json(data: Mapping[str, Any]) -> SavedRun:
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(f"not a saved benchmark run (format {found!r}, expected {FORMAT!r})")
    return SavedRun(
        rows=[_row(row) for row in data["rows"]],
        header=[str(part) for part in data.get("header", [])],
        notes=[str(note) for note in data.get("notes", [])],
        settings={str(name): int(value) for name, value in data.get("settings", {}).items()},
        cores=int(data.get("cores", 0)),
        seconds=float(data.get("seconds", 0.0)),
        engine=None if data.get("engine") is None else EngineFigures.from_json(data["engine"]),
    )


def write(path: Path, run: SavedRun) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_json(run), indent=2, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


def read(path: Path) -> SavedRun:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    try:
        return from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
