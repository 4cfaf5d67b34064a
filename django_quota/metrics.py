"""Observability: Prometheus metrics (with the ``prometheus`` extra) and the in-process
counts the admin status page shows. Labels are low-cardinality by construction: policy
ids, decisions, reasons, selector dimension names and backend modes, never an identity.

Families (docs/operations.md):

- ``django_quota_outcomes_total{policy,decision,reason,selector_dimensions,backend_mode}``:
  ``reason`` is the outcome's, or ``group_denied`` for an allowed outcome whose group
  another policy refused (it charged nothing)
- ``django_quota_backend_health_total{backend_mode,reason}``: ``reason`` is ``ok`` or a
  failure reason (``backend_timeout``, ``backend_unavailable``, ``backend_error``,
  ``indeterminate``, ``clock_unsafe``)
- ``django_quota_backend_latency_seconds{backend_mode}`` (histogram)

Under gunicorn with several workers set ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's
multiprocess mode) and expose :func:`django_quota.views.metrics`.

Without multiprocess mode a decision's counts are plain integers in this module's
dictionaries, under one lock, and a collector registered in prometheus_client's default
registry reads them at scrape time: the same families, labels and samples as
prometheus_client's own ``Counter`` and ``Histogram`` expose, at a fraction of their cost
per decision (each of their increments takes a lock of its own). In multiprocess mode the
values must live in the files the workers share, so they are prometheus_client's own
objects. The admin status page reads the same counts in either mode.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any, Final, Protocol

from django_quota.core.log import logger
from django_quota.core.outcome import (
    ALLOWED,
    DENIED_DECISION,
    FAILED_CLOSED,
    FAILED_OPEN,
    SHADOW_DENIED,
    Outcome,
)
from django_quota.core.policy import Policy

OK = "ok"
#: The ``reason`` label of an allowed outcome whose group another policy refused.
GROUP_DENIED = "group_denied"


class Families:
    """The metric families: their names, help texts and labels (``docs/metrics.md``)."""

    #: The counter families' names (prometheus_client's Counter adds ``_total``).
    COUNTERS: Final = {"outcomes": "django_quota_outcomes", "health": "django_quota_backend_health"}
    HELP: Final = {
        "outcomes": "Rate-limit decisions by policy, decision, reason, selector and backend mode.",
        "health": "Backend calls by backend mode and result (ok or a failure reason).",
        "latency": "Time of one backend call (one EVALSHA on Redis), in seconds.",
        "evicted": "Keys the Redis primary has evicted since it started (INFO stats), as last "
        "read by this process: any increase may have reset limits.",
    }
    #: The eviction gauge's name (read when the metrics view is scraped).
    EVICTED: Final = "django_quota_backend_evicted_keys"
    LABELS: Final = {
        "outcomes": ["policy", "decision", "reason", "selector_dimensions", "backend_mode"],
        "health": ["backend_mode", "reason"],
        "latency": ["backend_mode"],
        "evicted": ["node"],
    }
    LATENCY_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


prometheus_client: Any
try:  # the optional extra
    import prometheus_client
except ImportError:  # pragma: no cover - exercised only without the extra
    prometheus_client = None

#: prometheus_client's multiprocess mode, as prometheus_client itself chose it when it was
#: imported (``PROMETHEUS_MULTIPROC_DIR``, or its deprecated lowercase spelling, set).
MULTIPROCESS = prometheus_client is not None and (
    prometheus_client.values.ValueClass is not prometheus_client.values.MutexValue
)

_LOGGED = frozenset({DENIED_DECISION, SHADOW_DENIED, FAILED_CLOSED, FAILED_OPEN})
#: Seconds between two INFO lines of one outcome series (docs/metrics.md#logs): a client
#: hammering its limit writes one line a minute with a count, not one per refusal.
LOG_INTERVAL = 60.0


class Evaluated(Protocol):
    """Anything that names the policy it evaluated (the limiter's compiled policies)."""

    @property
    def policy(self) -> Policy: ...


started_at = time.time()

_SeriesKey = tuple[str, str, str, str, str]


class _Counts:
    """This process's counts, under one lock, and in multiprocess mode the
    prometheus_client metrics that share them with the other workers.

    One instance, ``_counts``. A count is ``[count, created (epoch s)]``; an outcome
    series, once a denial or failure of it was logged, also holds ``[count at that line,
    its time]`` (:func:`_line_due`).
    """

    __slots__ = (
        "backend_children", "evicted", "families", "families_lock", "health", "latency",
        "lock", "outcome_children", "outcomes",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: (policy, decision, reason, selector, backend_mode) -> count
        self.outcomes: dict[_SeriesKey, list[float]] = {}
        #: (backend_mode, reason) -> count
        self.health: dict[tuple[str, str], list[float]] = {}
        #: backend_mode -> [count per bucket of Families.LATENCY_BUCKETS, count above the last,
        #: sum (s), created]
        self.latency: dict[str, list[float]] = {}
        # Multiprocess mode only: prometheus_client's metrics, and their children by
        # labels (labels() is resolved once per combination, not once per decision).
        self.families: dict[str, Any] = {}
        # Not ``lock``: prometheus_client registers a new metric under its registry's lock,
        # and its registry may call the Collector (which takes ``lock``) under that lock.
        self.families_lock = threading.Lock()
        self.outcome_children: dict[_SeriesKey, Any] = {}
        self.backend_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        #: node -> the keys its Redis has evicted since it started, as last read
        self.evicted: dict[str, float] = {}

    # The counting below is written out in each method, not shared by a helper: both run
    # on every decision, and a helper would add a call to each.
    def count_outcome(self, key: _SeriesKey, logged: bool) -> int:
        """Count one outcome of series ``key``; return how many outcomes an INFO line
        stands for now when ``logged`` (:func:`_line_due`), else 0. The lock is taken
        with ``acquire``/``release``, not ``with``: -1,070 Python instructions a
        decision, half of the -2.7 % the memory backend's lock taken the same way also
        gives (``MemoryBackend.decide_call``; STYLE.md, "Speed")."""
        lock = self.lock
        lock.acquire()
        try:
            counted = self.outcomes.get(key)
            if counted is None:
                counted = self.outcomes[key] = [1, time.time()]
            else:
                counted[0] += 1
            return _line_due(counted) if logged else 0
        finally:
            lock.release()

    def count_backend(self, key: tuple[str, str], seconds: float | None) -> None:
        """Count one backend result ``(backend_mode, reason)`` and its latency (None: a
        backend without I/O, which has no latency histogram). The lock is taken as
        :meth:`count_outcome` takes it: -1,056 Python instructions per sync decision on
        Redis (``benchmarks/redis_instructions.py``; about as many per async one, within
        that row's run-to-run spread)."""
        lock = self.lock
        lock.acquire()
        try:
            counted = self.health.get(key)
            if counted is None:
                self.health[key] = [1, time.time()]
            else:
                counted[0] += 1
            if seconds is None:
                return
            # The bucket prometheus_client's Histogram counts it in: the first bound >= seconds.
            bucket = bisect.bisect_left(Families.LATENCY_BUCKETS, seconds)
            latency = self.latency.get(key[0])
            if latency is None:
                latency = self.latency[key[0]] = (
                    [0.0] * (len(Families.LATENCY_BUCKETS) + 2) + [time.time()]
                )
            latency[bucket] += 1
            latency[-2] += seconds
        finally:
            lock.release()

    def outcome_totals(self) -> dict[tuple[str, str, str], int]:
        """(policy, decision, reason) -> count, over selectors and backend modes."""
        totals: dict[tuple[str, str, str], int] = {}
        with self.lock:
            for (policy, decision, reason, _, _), counted in self.outcomes.items():
                key = (policy, decision, reason)
                totals[key] = totals.get(key, 0) + int(counted[0])
        return totals

    def snapshot(self) -> tuple[list[tuple[str, list[Any]]], list[tuple[str, list[float]]]]:
        """A copy, taken under the lock, of the counter samples by family name
        (``(labels, count, created)``) and of the latency rows by backend mode."""
        with self.lock:
            counters = [
                (name, [(key, values[0], values[1]) for key, values in table.items()])
                for name, table in (("outcomes", self.outcomes), ("health", self.health))
            ]
            latency = [(mode, list(values)) for mode, values in self.latency.items()]
        return counters, latency

    def family(self, name: str) -> Any:
        """The prometheus_client metric ``name``, created once per process."""
        family = self.families.get(name)
        if family is None:
            with self.families_lock:
                family = self.families.get(name)
                if family is None:
                    family = self.families[name] = _create(name)
        return family

    # The callers look a child up in its dict first: these two run once per combination.
    def add_outcome_child(self, key: _SeriesKey) -> Any:
        """Resolve and keep the outcomes metric's child of ``key``."""
        child = self.outcome_children[key] = self.family("outcomes").labels(*key)
        return child

    def add_backend_children(self, key: tuple[str, str], timed: bool) -> tuple[Any, Any]:
        """Resolve and keep the health and latency metrics' children of
        ``(backend_mode, reason)`` (no latency child for a backend that is not ``timed``:
        it would export a histogram of nothing)."""
        family = self.family("latency")  # registered either way, as without the mode
        latency = family.labels(key[0]) if timed else None
        children = self.backend_children[key] = (self.family("health").labels(*key), latency)
        return children


_counts = _Counts()


def _create(name: str) -> Any:
    assert prometheus_client is not None
    if name == "evicted":
        # Every worker reads the same server: the largest reading is the latest.
        return prometheus_client.Gauge(
            Families.EVICTED, Families.HELP[name], Families.LABELS[name], multiprocess_mode="max"
        )
    if name == "latency":
        return prometheus_client.Histogram(
            "django_quota_backend_latency_seconds",
            Families.HELP[name],
            Families.LABELS[name],
            buckets=Families.LATENCY_BUCKETS,
        )
    return prometheus_client.Counter(
        f"{Families.COUNTERS[name]}_total", Families.HELP[name], Families.LABELS[name]
    )


def record_outcomes(
    evaluated: Sequence[Evaluated | Policy],
    outcomes: Iterable[Outcome],
    group_denied: Collection[str] = (),
) -> None:
    """Count decided outcomes (never peeks) of one evaluation; log denials, shadow
    denials and failures (never an identity; at INFO one line per series and
    :data:`LOG_INTERVAL`, with a count, at DEBUG every one). ``evaluated`` holds the
    group's policies (or objects naming them), in any order. An allowed outcome of a policy in
    ``group_denied`` (its windows allowed, another policy of its group refused, nothing
    charged) is counted with reason :data:`GROUP_DENIED`, not as admitting."""
    for outcome in outcomes:
        reason = outcome.reason or ""
        if group_denied and outcome.policy in group_denied and outcome.decision == ALLOWED:
            reason = GROUP_DENIED
        # The selector is part of the key: a policy id may come back with another
        # selector (an edited admin policy, another settings generation).
        record_outcome(outcome, reason, _selector_label(evaluated, outcome.policy))


def record_outcome(outcome: Outcome, reason: str, selector: str) -> None:
    """Count one decided outcome under its ``reason`` label (its reason, ``""`` or
    :data:`GROUP_DENIED`) and its policy's ``selector`` label, and log it as
    :func:`record_outcomes` says (which calls this for each outcome; the limiter calls
    it directly for one policy, whose labels it has)."""
    decision = outcome.decision
    key = (outcome.policy, decision, reason, selector, outcome.backend_mode)
    standing_for = _counts.count_outcome(key, decision in _LOGGED)
    if MULTIPROCESS:
        child = _counts.outcome_children.get(key)
        if child is None:
            child = _counts.add_outcome_child(key)
        child.inc()
    if standing_for:
        logger.info(
            "quota %s: policy=%s reason=%s backend_mode=%s count=%d",
            decision,
            outcome.policy,
            reason,
            outcome.backend_mode,
            standing_for,
        )
    elif decision in _LOGGED and logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "quota %s: policy=%s reason=%s backend_mode=%s",
            decision,
            outcome.policy,
            reason,
            outcome.backend_mode,
        )


def _line_due(counted: list[float]) -> int:
    """How many outcomes of a series an INFO line stands for now (those since its last
    line, this one included), or 0 while its last line is under :data:`LOG_INTERVAL` old;
    the caller holds the counts' lock. The series' entry keeps the count at its last line and
    that line's time after its count and creation time."""
    now = time.time()
    if len(counted) == 2:  # never logged
        counted += (0, now - LOG_INTERVAL)
    if now - counted[3] < LOG_INTERVAL:
        return 0
    standing_for = int(counted[0] - counted[2])
    counted[2], counted[3] = counted[0], now
    return standing_for


def _selector_label(evaluated: Sequence[Evaluated | Policy], policy_id: str) -> str:
    for item in evaluated:
        policy = item if isinstance(item, Policy) else item.policy
        if policy.id == policy_id:
            return "+".join(policy.selector)
    return ""


def record_backend(backend_mode: str, reason: str, seconds: float | None) -> None:
    """Count one evaluation's backend result (``reason`` ``ok`` or a failure reason) and
    its latency (seconds, the whole evaluation with its retry; None: no latency). The
    memory backend's evaluations are not counted: it has no node to be healthy or not,
    and no I/O to time (``docs/metrics.md``)."""
    if prometheus_client is None:  # only Prometheus shows these (the status page does not)
        return
    key = (backend_mode, reason)
    _counts.count_backend(key, seconds)
    if MULTIPROCESS:
        children = _counts.backend_children.get(key)
        if children is None:
            children = _counts.add_backend_children(key, seconds is not None)
        children[0].inc()
        if seconds is not None:
            children[1].observe(seconds)


def record_evicted(node: str, evicted_keys: int) -> None:
    """The keys the Redis of ``node`` has evicted since it started, as just read
    (``django_quota.operations.eviction``): the ``django_quota_backend_evicted_keys``
    gauge."""
    if prometheus_client is None:
        return
    with _counts.lock:
        _counts.evicted[node] = float(evicted_keys)
    if MULTIPROCESS:
        _counts.family("evicted").labels(node).set(evicted_keys)


def outcome_counts() -> dict[tuple[str, str, str], int]:
    """(policy, decision, reason) -> count since this process started."""
    return _counts.outcome_totals()


class Collector:
    """The three families from this process's counts (not in multiprocess mode), read at
    scrape time by prometheus_client's registry: what its ``Counter`` and ``Histogram``
    of the same names would expose (``_total`` and ``_created``; ``_bucket``, ``_count``,
    ``_sum`` and ``_created``)."""

    def collect(self) -> Iterator[Any]:
        """Yield the families (prometheus_client ``Metric`` objects)."""
        assert prometheus_client is not None
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        from prometheus_client.utils import floatToGoString

        # prometheus_client's own switch: PROMETHEUS_DISABLE_CREATED_SERIES at its import,
        # or disable_created_metrics() since.
        created = bool(getattr(prometheus_client.metrics, "_use_created", True))
        counters, latency = _counts.snapshot()
        with _counts.lock:
            evicted = sorted(_counts.evicted.items())
        helps, labelled = Families.HELP, Families.LABELS
        gauge = GaugeMetricFamily(Families.EVICTED, helps["evicted"], labels=labelled["evicted"])
        for node, value in evicted:
            gauge.add_metric([node], value)
        yield gauge
        for name, samples in counters:
            family = CounterMetricFamily(
                Families.COUNTERS[name], helps[name], labels=labelled[name]
            )
            for labels, count, since in samples:
                family.add_metric(labels, count, created=since if created else None)
            yield family
        histogram = HistogramMetricFamily(
            "django_quota_backend_latency_seconds", helps["latency"], labels=labelled["latency"]
        )
        for mode, values in latency:
            total, buckets = 0.0, []
            for bound, count in zip(_bounds(floatToGoString), values, strict=False):
                total += count
                buckets.append((bound, total))
            histogram.add_metric([mode], buckets, values[-2])
            if created:
                histogram.add_sample(
                    "django_quota_backend_latency_seconds_created", {"backend_mode": mode},
                    values[-1],
                )
        yield histogram


def _bounds(to_text: Any) -> tuple[str, ...]:
    """The histogram's ``le`` label values, as prometheus_client writes them."""
    return tuple(to_text(bound) for bound in (*Families.LATENCY_BUCKETS, float("inf")))


if prometheus_client is not None and not MULTIPROCESS:
    try:
        prometheus_client.REGISTRY.register(Collector())
    except ValueError as exc:  # names taken in the default registry: never fail the import
        logger.warning("django_quota metrics are not exported: %s", exc)
