"""A settable clock for ``QUOTA["CLOCK"] = "tests.clock.now"`` (epoch seconds)."""

from __future__ import annotations

current = 1_764_000_000.0


def now() -> float:
    return current


def set_to(value: float) -> None:
    global current
    current = value


#: What :func:`unusable` returns, or raises when it is an exception.
unusable_value: object = None


def unusable() -> object:
    """A clock that misbehaves as ``unusable_value`` says (``QUOTA["CLOCK"]`` =
    ``"tests.clock.unusable"``)."""
    if isinstance(unusable_value, BaseException):
        raise unusable_value
    return unusable_value
