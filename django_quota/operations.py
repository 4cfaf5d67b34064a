"""The operator tools behind ``quota inspect`` and ``quota check``: each runs the real
path of an evaluation (this process's limiter, clock, prefix and lifetimes) and writes
nothing it does not remove (``docs/operations.md``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from django_quota import policies
from django_quota.core.errors import BackendError
from django_quota.core.outcome import CLOCK_UNSAFE
from django_quota.core.policy import (
    DEFAULT_WINDOW,
    FIXED_WINDOW,
    TOKEN_BUCKET,
    Policy,
    Window,
    settings_revision,
)
from django_quota.core.protocol import Probe
from django_quota.limiter import Subject, get_limiter
from django_quota.prepared import ClockUnusable


@dataclass(frozen=True, slots=True)
class Inspection:
    """What ``quota inspect`` shows: the policy, the subject's pseudonymous identity, and
    per window ``count`` (tokens for a token bucket), ``remaining``, ``reset_after``
    (seconds) and the counter's ``ttl_ms`` (-2: no state)."""

    policy: Policy
    identity: str
    windows: tuple[dict[str, object], ...]

    def as_dict(self) -> dict[str, object]:
        """The ``--json`` shape (``docs/operations.md``)."""
        return {
            "policy": self.policy.id,
            "revision": self.policy.revision,
            "source": self.policy.source,
            "identity": self.identity,
            "windows": list(self.windows),
        }


def inspect(policy_id: str, subject: Subject) -> Inspection:
    """Read a subject's windows without consuming or writing anything.

    Raises ``ValueError`` for a missing or invalid identity, :class:`UnknownPolicy` and
    :class:`BackendError` (the backend could not answer).
    """
    # A disabled policy keeps its counters: inspect them as if it were enabled.
    policy = dataclasses.replace(policies.get_policy(policy_id), enabled=True)
    limiter = get_limiter()
    identity = limiter.identity_for(policy, subject, "inspect")
    prepared = limiter.prepare([policy], subject, 1, peek=True)
    if prepared.clock_error is not None:
        raise BackendError(CLOCK_UNSAFE, f"QUOTA['CLOCK']: {prepared.clock_error}")
    assert prepared.request is not None
    backend = limiter.backend
    reply = backend.evaluate(prepared.request)
    outcome = limiter.interpret(prepared, reply, backend.mode)[0]
    ttl_ms = backend.ttl_ms(prepared.request.counters[0])
    windows = []
    for window in outcome.windows:
        tokens = policy.algorithm == TOKEN_BUCKET
        windows.append(
            {
                "window": window.name,
                "limit": window.limit,
                "count": window.remaining if tokens else window.limit - window.remaining,
                "remaining": window.remaining,
                "reset_after": window.reset_after,
                "ttl_ms": ttl_ms,
            }
        )
    return Inspection(policy, identity.label, tuple(windows))


#: The probe ``quota check`` evaluates: a route-only identity, so its key stays readable
#: (``<KEY_PREFIX>:{quota-check}:…``), and a one-second window, so it never lingers.
PROBE_POLICY = Policy(
    id="quota-check",
    algorithm=FIXED_WINDOW,
    windows=(Window(DEFAULT_WINDOW, 2, 1000, 2),),
    selector=("route",),
    revision=settings_revision(FIXED_WINDOW, ("route",), (Window(DEFAULT_WINDOW, 2, 1000, 2),)),
    source="check",
)


def probe() -> Probe:
    """The probe of ``quota check``: a peek and a charge of :data:`PROBE_POLICY`, built
    as every evaluation is (this process's clock, prefix and lifetimes)."""
    limiter = get_limiter()
    subject = {"route": "quota-check"}
    peek, charge = (
        limiter.prepare([PROBE_POLICY], subject, 1, peek=True),
        limiter.prepare([PROBE_POLICY], subject, 1),
    )
    if peek.clock_error is not None:
        raise ClockUnusable(peek.clock_error)
    peeking, charging = peek.request, charge.request
    assert peeking is not None and charging is not None
    return Probe(charging.counters[0], PROBE_POLICY.windows[0].limit, peeking, charging)


def diagnose() -> list[tuple[str, str, str]]:
    """(check, status, detail) rows about the backend, for ``quota check``: the backend
    runs the :func:`probe` too."""
    backend: Any = get_limiter().backend
    try:
        checked = probe()
    except ClockUnusable as exc:
        return [("clock", "error", f"QUOTA['CLOCK'] gives no usable time: {exc}")]
    return list(backend.diagnose(checked))
