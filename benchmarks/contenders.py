"""The rows of the table: django-quota's shapes and the peers, each as a ``Contender``.

A contender makes a ``Decide`` function (subject -> admitted?) for a *kind*: ``"bulk"``
(a limit never reached) or ``"exact"`` (the small limit of the exactness column). Every
decide function takes the subject as a client IP string, as each library would get it
from a request; peers whose package is not installed are left out with a note.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from benchmarks import django_settings as bench_settings

Decide = Callable[[str], bool]
BULK = "bulk"
EXACT = "exact"
DQ = "django-quota"
DQ_MEMORY = "django-quota (memory)"
ALLOWED = "allowed"


class DecisionFailed(RuntimeError):
    """A decision that was not a verdict (django-quota ``failed_*``): the run stops."""


@dataclass(frozen=True)
class Contender:
    """One row: how to build its decide function, and the row its ratio is taken to."""

    implementation: str
    algorithm: str
    key: str
    reference: str
    make: Callable[[str], Decide]
    uses_redis: bool = True
    context: Callable[[], contextlib.AbstractContextManager[None]] = field(
        default=contextlib.nullcontext
    )


def _dq_key(algorithm: str) -> str:
    return f"{DQ}/{algorithm}"


# -- django-quota ----------------------------------------------------------------------
def _quota_decide(policy_ids: Sequence[str]) -> Decide:
    from django_quota import evaluate
    from django_quota.limiter import evaluate_policies
    from django_quota.policies import get_policy

    if len(policy_ids) == 1:
        policy_id = policy_ids[0]

        def decide_one(subject: str) -> bool:
            outcome = evaluate(policy_id, {"ip": subject})
            if outcome.decision.startswith("failed"):
                raise DecisionFailed(f"{policy_id}: {outcome.decision} ({outcome.reason})")
            return outcome.decision == ALLOWED

        return decide_one

    group = [get_policy(policy_id) for policy_id in policy_ids]

    def decide_group(subject: str) -> bool:
        outcomes = evaluate_policies(group, {"ip": subject})
        for outcome in outcomes:
            if outcome.decision.startswith("failed"):
                raise DecisionFailed(f"{outcome.policy}: {outcome.decision} ({outcome.reason})")
        return all(outcome.decision == ALLOWED for outcome in outcomes)

    return decide_group


def _quota_maker(names: Sequence[str]) -> Callable[[str], Decide]:
    def make(kind: str) -> Decide:
        to_id = bench_settings.bulk_id if kind == BULK else bench_settings.exact_id
        return _quota_decide([to_id(name) for name in names])

    return make


@contextlib.contextmanager
def _memory_backend(redis_url: str, limit: int) -> Iterator[None]:
    from django.test import override_settings

    quota = bench_settings.quota_settings(redis_url, limit, backend="memory")
    with override_settings(QUOTA=quota):
        yield


def django_quota_contenders(redis_url: str, limit: int) -> list[Contender]:
    rows = [
        Contender(DQ, algorithm, _dq_key(algorithm), _dq_key(algorithm), _quota_maker([algorithm]))
        for algorithm in bench_settings.ALGORITHMS
    ]
    fixed = _dq_key("fixed_window")
    rows.append(
        Contender(
            DQ,
            "sliding_window, 2 windows (1 s + 1 h)",
            _dq_key("two_windows"),
            _dq_key("sliding_window"),
            _quota_maker([bench_settings.TWO_WINDOWS]),
        )
    )
    rows.append(
        Contender(
            DQ,
            "2 policies, 1 call (fixed + sliding)",
            _dq_key("two_policies"),
            fixed,
            _quota_maker(["fixed_window", "sliding_window"]),
        )
    )
    rows.append(
        Contender(
            DQ_MEMORY,
            "fixed_window",
            f"{DQ_MEMORY}/fixed_window",
            fixed,
            _quota_maker(["fixed_window"]),
            uses_redis=False,
            context=lambda: _memory_backend(redis_url, limit),
        )
    )
    return rows


# -- limits ------------------------------------------------------------------------------
def limits_contenders(
    redis_url: str, limit: int, notes: list[str], versions: dict[str, str]
) -> list[Contender]:
    if importlib.util.find_spec("limits") is None:
        notes.append("limits is not installed (pip install -e '.[bench]'): rows skipped")
        return []
    import limits
    import limits.strategies as strategies
    from limits.storage import storage_from_string

    storage = storage_from_string(redis_url)
    items = {
        BULK: limits.parse(f"{bench_settings.BULK_LIMIT}/hour"),
        EXACT: limits.parse(f"{limit}/day"),
    }
    version = getattr(limits, "__version__", "?")
    versions["limits"] = version
    shapes: list[tuple[str, str, str]] = [
        ("FixedWindowRateLimiter", "fixed_window", _dq_key("fixed_window")),
        ("SlidingWindowCounterRateLimiter", "sliding_window", _dq_key("sliding_window")),
        ("MovingWindowRateLimiter", "moving window (log)", _dq_key("fixed_window")),
    ]
    rows = []
    for class_name, algorithm, reference in shapes:
        limiter_class = getattr(strategies, class_name, None)
        if limiter_class is None:
            notes.append(f"limits {version} has no {class_name}: row skipped")
            continue
        limiter = limiter_class(storage)

        def make(kind: str, limiter: Any = limiter) -> Decide:
            item = items[kind]

            def decide(subject: str) -> bool:
                return bool(limiter.hit(item, "bench", subject))

            return decide

        rows.append(
            Contender(
                f"limits {class_name.removesuffix('RateLimiter')}",
                algorithm,
                f"limits/{class_name}",
                reference,
                make,
            )
        )
    return rows


# -- DRF ---------------------------------------------------------------------------------
def _request(subject: str) -> Any:
    """What the cache-based peers read from a request: an anonymous user and REMOTE_ADDR."""
    from django.contrib.auth.models import AnonymousUser

    return SimpleNamespace(
        user=AnonymousUser(), META={"REMOTE_ADDR": subject}, headers={}, method="GET"
    )


def drf_contenders(limit: int, notes: list[str], versions: dict[str, str]) -> list[Contender]:
    if importlib.util.find_spec("rest_framework") is None:
        notes.append("djangorestframework is not installed: DRF row skipped")
        return []
    import rest_framework
    from rest_framework.throttling import AnonRateThrottle

    versions["djangorestframework"] = rest_framework.VERSION
    rates = {BULK: f"{bench_settings.BULK_LIMIT}/hour", EXACT: f"{limit}/day"}

    def make(kind: str) -> Decide:
        throttle_class = type("BenchAnonRateThrottle", (AnonRateThrottle,), {"rate": rates[kind]})

        def decide(subject: str) -> bool:
            # DRF builds a throttle instance per request (APIView.get_throttles).
            return bool(throttle_class().allow_request(_request(subject), None))

        return decide

    return [
        Contender(
            "DRF AnonRateThrottle",
            "sliding log (SimpleRateThrottle)",
            "drf/AnonRateThrottle",
            _dq_key("fixed_window"),
            make,
        )
    ]


# -- django-ratelimit --------------------------------------------------------------------
def ratelimit_contenders(limit: int, notes: list[str], versions: dict[str, str]) -> list[Contender]:
    if importlib.util.find_spec("django_ratelimit") is None:
        notes.append("django-ratelimit is not installed (pip install -e '.[bench]'): skipped")
        return []
    from importlib.metadata import version

    from django_ratelimit.core import is_ratelimited  # type: ignore[import-untyped]

    versions["django-ratelimit"] = version("django-ratelimit")
    rates = {BULK: f"{bench_settings.BULK_LIMIT}/h", EXACT: f"{limit}/d"}

    def make(kind: str) -> Decide:
        rate = rates[kind]

        def decide(subject: str) -> bool:
            limited = is_ratelimited(
                _request(subject), group="bench", key="ip", rate=rate, increment=True
            )
            return not limited

        return decide

    return [
        Contender(
            "django-ratelimit",
            "fixed_window (cache add + incr)",
            "django-ratelimit",
            _dq_key("fixed_window"),
            make,
        )
    ]


def all_contenders(
    redis_url: str, limit: int, notes: list[str], versions: dict[str, str]
) -> list[Contender]:
    """Every row, django-quota's first; ``notes`` and ``versions`` are filled in."""
    return [
        *django_quota_contenders(redis_url, limit),
        *limits_contenders(redis_url, limit, notes, versions),
        *drf_contenders(limit, notes, versions),
        *ratelimit_contenders(limit, notes, versions),
    ]
