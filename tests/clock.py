"""A settable clock for ``QUOTA["CLOCK"] = "tests.clock.now"`` (epoch seconds)."""

from __future__ import annotations

current = 1_764_000_000.0


def now() -> float:
    return current


def set_to(value: float) -> None:
    global current
    current = value
