"""The rows of the table: django-quota's shapes and the peers, each as a ``Contender``.

A contender makes a ``Decide`` function (subject -> admitted?) for a *kind*: ``"bulk"``
(a limit never reached) or ``"exact"`` (the small limit of the exactness column); an
async row makes an ``ADecide`` (the same, awaited) instead, inside the event loop that
runs it. Every decide function takes the subject as a client IP string, as each library
would get it from a request; peers whose package is not installed are left out with a
note. The whole-request rows live in :mod:`benchmarks.whole_request`.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from benchmarks import django_settings as bench_settings

if TYPE_CHECKING:
    from django_quota import Outcome

Decide = Callable[[str], bool]
ADecide = Callable[[str], Coroutine[Any, Any, bool]]
Maker = Callable[[str], Decide]
#: Called inside the running event loop (async clients belong to one loop).
AsyncMaker = Callable[[str], ADecide]
BULK = "bulk"
EXACT = "exact"
DQ = "django-quota"
DQ_ASYNC = "django-quota (async)"
DQ_MEMORY = "django-quota (memory)"
LIMITS_ASYNC = "limits (async)"
LIMITS_MEMORY = "limits (memory)"
ALLOWED = "allowed"

#: Row keys the goals are computed from.
DQ_FIXED = f"{DQ}/fixed_window"
DQ_SLIDING = f"{DQ}/sliding_window"
DQ_SLIDING_LOG = f"{DQ}/sliding_log"
DQ_TOKEN = f"{DQ}/token_bucket"
DQ_TWO_WINDOWS = f"{DQ}/two_windows"
DQ_TWO_POLICIES = f"{DQ}/two_policies"
DQ_CALENDAR = f"{DQ}/calendar_month"

DQ_CONCURRENCY = f"{DQ}/concurrency"
DQ_ASYNC_FIXED = f"{DQ_ASYNC}/fixed_window"
DQ_MEMORY_FIXED = f"{DQ_MEMORY}/fixed_window"
LIMITS_FIXED = "limits/FixedWindowRateLimiter"
LIMITS_SLIDING = "limits/SlidingWindowCounterRateLimiter"
LIMITS_MOVING = "limits/MovingWindowRateLimiter"
LIMITS_ASYNC_FIXED = f"{LIMITS_ASYNC}/FixedWindowRateLimiter"
LIMITS_MEMORY_FIXED = f"{LIMITS_MEMORY}/FixedWindowRateLimiter"


class DecisionFailed(RuntimeError):
    """A decision that was not a verdict (django-quota ``failed_*``): the run stops."""


@dataclass(frozen=True)
class Contender:
    """One row: how to build its decide function, and the row its ratio is taken to.

    A sync row has ``make``; an async row has ``amake`` instead (and ``make`` None).
    ``reference`` is the key of the row its ratio is taken to ("" for none). ``exact``:
    whether the exactness column is measured. ``base``: for whole-request rows, the key
    of the row whose latency this one adds to.
    """

    implementation: str
    algorithm: str
    key: str
    reference: str
    make: Maker | None
    uses_redis: bool = True
    context: Callable[[], contextlib.AbstractContextManager[None]] = field(
        default=contextlib.nullcontext
    )
    amake: AsyncMaker | None = None
    exact: bool = True
    base: str | None = None

    def __post_init__(self) -> None:
        if (self.make is None) == (self.amake is None):
            raise ValueError(f"{self.key}: exactly one of make and amake")

    @property
    def name(self) -> str:
        """What ``--only`` matches and the breakdowns print."""
        return f"{self.implementation} {self.algorithm}"

    def decide(self, kind: str) -> Decide:
        """The decide function of a sync row."""
        if self.make is None:
            raise TypeError(f"{self.key} is an async row: use amake")
        return self.make(kind)


def _dq_key(algorithm: str) -> str:
    return f"{DQ}/{algorithm}"


# -- django-quota ----------------------------------------------------------------------
def _admitted(outcomes: Sequence[Outcome]) -> bool:
    """Whether every outcome admits; a ``failed_*`` one stops the run."""
    for outcome in outcomes:
        if outcome.decision.startswith("failed"):
            raise DecisionFailed(f"{outcome.policy}: {outcome.decision} ({outcome.reason})")
    return all(outcome.decision == ALLOWED for outcome in outcomes)


def _quota_decide(policy_ids: Sequence[str]) -> Decide:
    from django_quota import evaluate
    from django_quota.limiter import evaluate_policies
    from django_quota.policies import get_policy

    if len(policy_ids) == 1:
        policy_id = policy_ids[0]

        def decide_one(subject: str) -> bool:
            return _admitted([evaluate(policy_id, {"ip": subject})])

        return decide_one

    group = [get_policy(policy_id) for policy_id in policy_ids]

    def decide_group(subject: str) -> bool:
        return _admitted(evaluate_policies(group, {"ip": subject}))

    return decide_group


def _concurrency_maker() -> Maker:
    """A concurrency policy's acquire (one ``evaluate.lua`` call) and release (one
    ``release.lua`` call), as a view under ``@quota`` costs: one row, two calls."""

    def make(kind: str) -> Decide:
        from django_quota import evaluate, release

        policy_id = _to_id(kind)(bench_settings.CONCURRENCY)

        def decide(subject: str) -> bool:
            outcome = evaluate(policy_id, {"ip": subject})
            admitted = _admitted([outcome])
            release(policy_id, {"ip": subject}, outcome.evaluation_id)
            return admitted

        return decide

    return make


def _to_id(kind: str) -> Callable[[str], str]:
    return bench_settings.bulk_id if kind == BULK else bench_settings.exact_id


def _quota_maker(names: Sequence[str]) -> Maker:
    def make(kind: str) -> Decide:
        to_id = _to_id(kind)
        return _quota_decide([to_id(name) for name in names])

    return make


def _quota_async_maker(name: str) -> AsyncMaker:
    def amake(kind: str) -> ADecide:
        from django_quota import aevaluate

        policy_id = _to_id(kind)(name)

        async def decide(subject: str) -> bool:
            return _admitted([await aevaluate(policy_id, {"ip": subject})])

        return decide

    return amake


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
    rows.append(
        Contender(
            DQ,
            "sliding_window, 2 windows (1 s + 1 h)",
            DQ_TWO_WINDOWS,
            DQ_SLIDING,
            _quota_maker([bench_settings.TWO_WINDOWS]),
        )
    )
    rows.append(
        Contender(
            DQ,
            "calendar month (Europe/Berlin)",
            DQ_CALENDAR,
            DQ_FIXED,
            _quota_maker([bench_settings.CALENDAR_MONTH]),
        )
    )
    rows.append(
        Contender(
            DQ,
            "2 policies, 1 call (fixed + sliding)",
            DQ_TWO_POLICIES,
            DQ_FIXED,
            _quota_maker(["fixed_window", "sliding_window"]),
        )
    )
    rows.append(
        Contender(
            DQ,
            "concurrency, acquire + release",
            DQ_CONCURRENCY,
            DQ_FIXED,
            _concurrency_maker(),
            exact=False,  # every lease is released: nothing to exhaust
        )
    )
    rows.append(
        Contender(
            DQ_ASYNC,
            "fixed_window",
            DQ_ASYNC_FIXED,
            DQ_ASYNC_FIXED,
            None,
            amake=_quota_async_maker("fixed_window"),
        )
    )
    rows.append(
        Contender(
            DQ_MEMORY,
            "fixed_window",
            DQ_MEMORY_FIXED,
            DQ_FIXED,
            _quota_maker(["fixed_window"]),
            uses_redis=False,
            context=lambda: _memory_backend(redis_url, limit),
        )
    )
    return rows


# -- limits ------------------------------------------------------------------------------
def _limits_maker(limiter: Any, items: dict[str, Any]) -> Maker:
    def make(kind: str) -> Decide:
        item = items[kind]

        def decide(subject: str) -> bool:
            return bool(limiter.hit(item, "bench", subject))

        return decide

    return make


def _limits_async_maker(storage_uri: str, items: dict[str, Any]) -> AsyncMaker:
    def amake(kind: str) -> ADecide:
        from limits.aio.storage import Storage
        from limits.aio.strategies import FixedWindowRateLimiter
        from limits.storage import storage_from_string

        # A new storage per event loop: its redis.asyncio pool belongs to the loop that
        # first uses it (django-quota keeps one async client per loop likewise).
        storage = storage_from_string(storage_uri, implementation="redispy")
        if not isinstance(storage, Storage):
            raise TypeError(f"{storage_uri} did not give limits an async storage")
        limiter = FixedWindowRateLimiter(storage)
        item = items[kind]

        async def decide(subject: str) -> bool:
            return bool(await limiter.hit(item, "bench", subject))

        return decide

    return amake


def limits_contenders(
    redis_url: str, limit: int, notes: list[str], versions: dict[str, str]
) -> list[Contender]:
    if importlib.util.find_spec("limits") is None:
        notes.append("limits is not installed (pip install -e '.[bench]'): rows skipped")
        return []
    import limits
    import limits.strategies as strategies
    from limits.storage import MemoryStorage, storage_from_string

    storage = storage_from_string(redis_url)
    items = {
        BULK: limits.parse(f"{bench_settings.BULK_LIMIT}/hour"),
        EXACT: limits.parse(f"{limit}/day"),
    }
    version = getattr(limits, "__version__", "?")
    versions["limits"] = version
    shapes: list[tuple[str, str, str]] = [
        ("FixedWindowRateLimiter", "fixed_window", DQ_FIXED),
        ("SlidingWindowCounterRateLimiter", "sliding_window", DQ_SLIDING),
        ("MovingWindowRateLimiter", "moving window (log)", DQ_SLIDING_LOG),
    ]
    rows = []
    for class_name, algorithm, reference in shapes:
        limiter_class = getattr(strategies, class_name, None)
        if limiter_class is None:
            notes.append(f"limits {version} has no {class_name}: row skipped")
            continue
        rows.append(
            Contender(
                f"limits {class_name.removesuffix('RateLimiter')}",
                algorithm,
                f"limits/{class_name}",
                reference,
                _limits_maker(limiter_class(storage), items),
            )
        )
    rows.append(
        Contender(
            f"{LIMITS_ASYNC} FixedWindow",
            "fixed_window",
            LIMITS_ASYNC_FIXED,
            DQ_ASYNC_FIXED,
            None,
            amake=_limits_async_maker(f"async+{redis_url}", items),
        )
    )
    rows.append(
        Contender(
            f"{LIMITS_MEMORY} FixedWindow",
            "fixed_window",
            LIMITS_MEMORY_FIXED,
            DQ_MEMORY_FIXED,
            _limits_maker(strategies.FixedWindowRateLimiter(MemoryStorage()), items),
            uses_redis=False,
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
            DQ_FIXED,
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
    return [
        Contender(
            "django-ratelimit",
            "fixed_window (cache add + incr)",
            "django-ratelimit",
            DQ_FIXED,
            _ratelimit_maker(is_ratelimited, limit),
        )
    ]


def _ratelimit_maker(is_ratelimited: Callable[..., Any], limit: int) -> Maker:
    """A row deciding with ``is_ratelimited`` (django-ratelimit's, or the drop-in's) as a
    view's ``@ratelimit(key="ip")`` would: the bulk or exact rate, one count each."""
    rates = {BULK: f"{bench_settings.BULK_LIMIT}/h", EXACT: f"{limit}/d"}

    def make(kind: str) -> Decide:
        rate = rates[kind]

        def decide(subject: str) -> bool:
            limited = is_ratelimited(
                _request(subject), group="bench", key="ip", rate=rate, increment=True
            )
            return not limited

        return decide

    return make


def quota_ratelimit_contenders(limit: int) -> list[Contender]:
    """django-quota's django-ratelimit drop-in, called as django-ratelimit's row is."""
    from django_quota.ratelimit.core import is_ratelimited

    return [
        Contender(
            f"{DQ} ratelimit drop-in",
            "fixed window (one script)",
            f"{DQ}/ratelimit",
            DQ_FIXED,
            _ratelimit_maker(is_ratelimited, limit),
        )
    ]


def all_contenders(
    redis_url: str, limit: int, notes: list[str], versions: dict[str, str]
) -> list[Contender]:
    """Every row, django-quota's first; ``notes`` and ``versions`` are filled in."""
    from benchmarks import whole_request

    return [
        *django_quota_contenders(redis_url, limit),
        *limits_contenders(redis_url, limit, notes, versions),
        *drf_contenders(limit, notes, versions),
        *ratelimit_contenders(limit, notes, versions),
        *quota_ratelimit_contenders(limit),
        *whole_request.contenders(notes),
    ]
