"""The operator tools behind ``quota inspect`` and ``quota check``: each runs the real
path of an evaluation (this process's limiter, clock, prefix and lifetimes) and writes
nothing it does not remove (``docs/operations.md``)."""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import Any, Final

from django.apps import apps as django_apps

from django_quota import conf, metrics, policies
from django_quota.core.errors import BackendError
from django_quota.core.outcome import CLOCK_UNSAFE
from django_quota.core.policy import (
    ALGORITHMS,
    FIXED_WINDOW,
    SLIDING_LOG,
    TOKEN_BUCKET,
    Form,
    Policy,
    Window,
    settings_revision,
)
from django_quota.core.protocol import Probe
from django_quota.engine.prepared import ClockUnusable
from django_quota.limiter import Subject, get_limiter
from django_quota.scripts import all_scripts


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


def inspect(policy_id: str, subject: Subject, *, plan: str | None = None) -> Inspection:
    """Read a subject's windows without consuming or writing anything, under ``plan``'s
    limits for a policy with plans (docs/plans.md; None: the policy's own windows).

    Raises ``ValueError`` for a missing or invalid identity, :class:`UnknownPolicy` and
    :class:`BackendError` (the backend could not answer).
    """
    # A disabled policy keeps its counters: inspect them as if it were enabled.
    policy = dataclasses.replace(policies.get_policy(policy_id), enabled=True)
    limiter = get_limiter()
    identity = limiter.identity_for(policy, subject, "inspect")
    prepared = limiter.prepare([policy], subject, 1, peek=True, plan=plan)
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


class Probing:
    """What ``quota check`` probes each algorithm with."""

    #: The probe policies' one window: 3 units a second, so that a probe never lingers.
    WINDOW: Final = Window(Form.DEFAULT_WINDOW, 3, 1000, 3)
    #: The sliding log's charges, in ms after its peek: the third comes when the first has
    #: left the window and the second has not, so that the script trims the list (LTRIM).
    #: Each with the ``remaining`` it reports.
    LOG_CHARGES: Final = ((0, 2), (600, 1), (1100, 1))


def probe_policy(algorithm: str) -> Policy:
    """The probe ``quota check`` evaluates for ``algorithm``: a route-only identity, so
    its key stays readable (``<KEY_PREFIX>:{quota-check}:…``)."""
    selector = ("route",)
    name = "quota-check" if algorithm == FIXED_WINDOW else f"quota-check.{algorithm}"
    revision = settings_revision(algorithm, selector, (Probing.WINDOW,))
    return Policy(name, algorithm, (Probing.WINDOW,), selector, revision=revision, source="check")


def algorithms_in_use() -> list[str]:
    """The algorithms ``quota check`` probes: the fixed window always, every enabled
    policy's, and the drop-in DRF throttles' ``DRF_ALGORITHM`` where DRF is installed
    (``docs/operations.md``)."""
    used = {FIXED_WINDOW}
    used |= {policy.algorithm for policy in policies.get_registry().policies.values()}
    if django_apps.is_installed("rest_framework"):
        used.add(conf.get_settings().drf_algorithm)
    return [algorithm for algorithm in ALGORITHMS if algorithm in used]


def probe(algorithm: str = FIXED_WINDOW) -> Probe:
    """The probe of ``algorithm``: a peek and charges of :func:`probe_policy`, built as
    every evaluation is (this process's clock, prefix and lifetimes). The sliding log's
    come at the times of ``Probing.LOG_CHARGES`` after now, on this host's clock, so that
    its list is trimmed as traffic trims it."""
    limiter = get_limiter()
    policy = probe_policy(algorithm)
    subject = {"route": "quota-check"}
    timed: list[tuple[float | None, int]]
    if algorithm == SLIDING_LOG:
        start = time.time()
        timed = [(start + after / 1000, remaining) for after, remaining in Probing.LOG_CHARGES]
    else:
        timed = [(None, Probing.WINDOW.limit - 1)]

    def clock_at(moment: float | None) -> Any:
        return None if moment is None else (lambda: moment)

    peek = limiter.prepare([policy], subject, 1, peek=True, clock=clock_at(timed[0][0]))
    if peek.clock_error is not None:
        raise ClockUnusable(peek.clock_error)
    charges = []
    for moment, remaining in timed:
        charge = limiter.prepare([policy], subject, 1, clock=clock_at(moment))
        assert charge.request is not None
        charges.append((charge.request, remaining))
    assert peek.request is not None
    counter = peek.request.counters[0]
    return Probe(counter, Probing.WINDOW.limit, algorithm, peek.request, tuple(charges))


def diagnose() -> list[tuple[str, str, str]]:
    """(check, status, detail) rows about the backend, for ``quota check``: the backend
    runs the :func:`probe` of every algorithm in use too."""
    backend: Any = get_limiter().backend
    try:
        checked = [probe(algorithm) for algorithm in algorithms_in_use()]
    except ClockUnusable as exc:
        return [("clock", "error", f"QUOTA['CLOCK'] gives no usable time: {exc}")]
    return list(backend.diagnose(checked))


# -- eviction ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Eviction:
    """What a Redis primary may do to counters under memory pressure (``docs/operations.md``,
    "Eviction"): its ``maxmemory-policy`` and ``maxmemory``, the keys it has evicted since it
    started (``INFO stats``), and how many of those came since this process first read
    them (at ``first_read``, epoch seconds)."""

    node: str
    policy: str
    maxmemory: int
    evicted_keys: int
    evicted_since_first_read: int
    first_read: float

    @property
    def evicting(self) -> bool:
        """Whether the primary may evict live counters: a policy other than
        ``noeviction`` under a ``maxmemory`` limit."""
        return self.policy != "noeviction" and self.maxmemory != 0


def eviction() -> list[Eviction]:
    """Every primary's :class:`Eviction`, read now; ``[]`` for the memory backend. Raises
    :class:`BackendError` when a primary cannot be read (unreachable, or an ACL without
    ``INFO``). Each reading is also the ``django_quota_backend_evicted_keys`` gauge's."""
    limiter = get_limiter()
    backend: Any = limiter.backend
    read = getattr(backend, "memory_info", None)
    if read is None:
        return []
    try:
        found = read()
    except BackendError:
        raise
    except Exception as exc:
        raise backend.classify(exc) from exc
    now = time.time()
    first = limiter.first_evicted
    readings = []
    for node, policy, maxmemory, evicted in found:
        baseline, since = first.setdefault(node, (evicted, now))
        if evicted < baseline:  # the server restarted: its count started again
            baseline, since = first[node] = (0, now)
        metrics.record_evicted(node, evicted)
        readings.append(Eviction(node, policy, maxmemory, evicted, evicted - baseline, since))
    return readings


# -- the ACL the scripts need --------------------------------------------------------------
class Acl:
    """The commands a Redis user needs (:func:`acl_setuser`)."""

    #: What the client itself sends for an evaluation: the scripts by SHA1, and their
    #: load after a ``NOSCRIPT``.
    EVALUATION_COMMANDS: Final = ("evalsha", "script|load")
    #: What ``quota inspect``, ``quota check``, the eviction check, the status page and
    #: the metrics view send besides (``CONFIG GET``, for the ``maxmemory-policy`` row, is
    #: left out: it would show the server's whole configuration).
    OPERATOR_COMMANDS: Final = ("pttl", "ping", "info")
    #: A script's ``redis.call``/``redis.pcall`` and the command it names.
    SCRIPT_CALL_RE: Final = re.compile(r"redis\.p?call\(\s*'([A-Za-z]+)'")


def script_commands() -> list[str]:
    """Every command the Lua scripts run (``redis.call``/``redis.pcall``), lower-cased,
    sorted: read from the scripts themselves."""
    found: set[str] = set()
    for source in all_scripts():
        found |= {name.lower() for name in Acl.SCRIPT_CALL_RE.findall(source.source)}
    return sorted(found)


def acl_setuser(user: str, password: str, key_prefix: str) -> str:
    """The ``ACL SETUSER`` line of a user that can run every evaluation, reset,
    ``quota inspect`` and ``quota check`` on keys under ``key_prefix`` and nothing else
    (``docs/operations.md``)."""
    commands = [*Acl.EVALUATION_COMMANDS, *script_commands(), *Acl.OPERATOR_COMMANDS]
    rules = ["on", f">{password}", f"~{key_prefix}:*", *(f"+{name}" for name in commands)]
    return f"ACL SETUSER {user} {' '.join(rules)}"
