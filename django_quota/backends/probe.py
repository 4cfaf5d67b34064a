"""``quota check``'s probe, run the same way on every Redis backend: a peek and a charge
of a probe counter with the evaluation script, ``reset.lua``, then the probe removed, so
that the check fails whenever evaluations would (``docs/operations.md``)."""

from __future__ import annotations

from collections.abc import Callable

from django_quota.backends import Backend
from django_quota.core.errors import BackendError
from django_quota.core.model import CHARGED, UNCHARGED
from django_quota.core.protocol import GroupReply, Probe

Row = tuple[str, str, str]
NAME = "evaluation"


def _remaining(reply: GroupReply, expected: int) -> int | None:
    """The probe window's ``remaining`` when the reply decided with status ``expected``."""
    if reply.clock_unsafe or reply.indeterminate or reply.replayed or len(reply.results) != 1:
        return None
    result = reply.results[0]
    return result.windows[0].remaining if result.status == expected else None


def run_probe(backend: Backend, probe: Probe, delete: Callable[[str], object]) -> Row:
    """The ``evaluation`` row: ``error`` when a step fails or decides otherwise than a
    healthy backend would; ``warning`` when only the removal of the probe failed (it then
    expires by itself)."""
    try:
        peeked = _remaining(backend.evaluate(probe.peek), UNCHARGED)
    except BackendError as exc:
        return (NAME, "error", f"peek failed ({exc.reason}): {exc}")
    if peeked is None:
        return (NAME, "error", "peek of the probe counter did not decide 'allowed'")
    try:
        charged = _remaining(backend.evaluate(probe.charge), CHARGED)
    except BackendError as exc:
        return (NAME, "error", f"charge failed ({exc.reason}): {exc}")
    if charged != peeked - 1:
        return (NAME, "error", "charge of the probe counter did not charge exactly 1")
    try:
        backend.reset(probe.counter, 1)
    except BackendError as exc:
        return (NAME, "error", f"reset failed ({exc.reason}): {exc}")
    try:
        delete(probe.counter)  # reset.lua keeps the evaluation-id ledger by design
        left = backend.ttl_ms(probe.counter)
    except Exception as exc:
        return (NAME, "warning", f"the probe counter {probe.counter} was not removed: {exc}")
    if left != -2:
        return (NAME, "warning", f"the probe counter {probe.counter} is left ({left} ms)")
    return (
        NAME,
        "ok",
        f"evaluate.lua peeked ({peeked} of {probe.limit} left) and charged ({charged} of "
        f"{probe.limit} left) a probe counter, reset.lua reset it, and it was removed",
    )
