"""``evaluate()`` and ``aevaluate()`` on Redis run the common call without a group, a
request or a parsed reply (``Limiter.shortcut``, docs/architecture.md): held here to the
same script calls, outcomes, outcome and backend counts and recent errors as ``prepare``
and ``run`` (``arun``), over random sequences of every algorithm, shape and cost on
fakeredis and on a real redis-server, and over failures (Redis stopped, timeouts, a retry,
an open breaker, the local fallback, malformed and undecided replies).

The two limiters compared get the same evaluation ids (so the same fingerprints): the
short path's limiter runs each call on Redis and records it with its reply or failure;
the general path's limiter must make the very same call, and is answered with that reply
(so both read one reply, whatever Redis's clock did in between)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
import redis

from django_quota import conf, limiter, metrics
from django_quota.backends.memory import MemoryBackend
from django_quota.backends.redis import RedisBackend
from django_quota.backends.scripting import Call
from django_quota.core.errors import BackendError
from django_quota.core.outcome import (
    BACKEND_MODE_FALLBACK,
    BACKEND_TIMEOUT,
    BACKEND_UNAVAILABLE,
    INDETERMINATE,
    Outcome,
)
from django_quota.core.policy import Policy
from django_quota.engine import Limiter
from tests.differential import fake_backend, prepared_costs
from tests.test_memory_short_path import CALENDAR
from tests.test_memory_short_path import POLICIES as MEMORY_POLICIES
from tests.test_memory_short_path import SHORT as MEMORY_SHORT

#: The memory backend's short path's policies (the short calls first), and one failing
#: open and one with a calendar window.
POLICIES = {
    **MEMORY_POLICIES,
    "open": {"windows": "3/m", "selector": ["ip"], "failure_mode": "open"},
    "two_sliding": {
        "algorithm": "sliding_window",
        "windows": {"burst": "2/s", "sustained": "5/m"},
        "selector": ["ip"],
    },
    **CALENDAR,
}
#: On Redis, a policy of several windows takes the short path too ("two", "two_sliding").
SHORT = {*MEMORY_SHORT, "open", "two", "two_sliding"}
SUBJECTS = [{"ip": "203.0.113.1"}, {"ip": "203.0.113.2"}, {"ip": "not an ip"}, {}]
FIXED_REPLY_NOW = 1_764_806_400_123


class Ids:
    """The evaluation ids both limiters give out, the same for the same step, and the
    monotonic clock the limiters and the denial cache read, held still for the step (a
    remembered refusal's numbers are answered by it)."""

    def __init__(self) -> None:
        self.current = "step-0"
        self.monotonic = time.monotonic

    def __call__(self) -> str:
        return self.current

    def step(self, step: int) -> None:
        self.current = f"step-{step}"
        held = time.monotonic()
        self.monotonic = lambda: held

    def time(self) -> float:
        return time.time()


@pytest.fixture
def ids(monkeypatch: pytest.MonkeyPatch) -> Ids:
    given = Ids()
    for module in ("engine.decisions", "engine.short_path"):
        monkeypatch.setattr(f"django_quota.{module}.new_evaluation_id", given)
    for module in ("engine.decisions", "engine.short_path", "engine.interpreting", "core.denials"):
        monkeypatch.setattr(f"django_quota.{module}.time", given)
    return given


def _settings(**values: Any) -> conf.QuotaSettings:
    parsed, problems = conf.parse_settings(
        {
            "HMAC_KEY": "tests-hmac-key-0123456789",
            "REDIS_URL": "redis://short-path.invalid:6379/0",
            "POLICIES": POLICIES,
            **values,
        },
        secret_key="tests",
    )
    assert problems == [] and parsed is not None
    return parsed


Log = list[tuple[Call, Any]]


def _recording(backend: RedisBackend) -> Log:
    """Record each call ``backend`` runs, with its raw reply or failure (once: a young
    loop's ``arun`` runs ``run`` in a thread)."""
    log: Log = []
    real_run, real_arun = backend.run, backend.arun
    inside: list[bool] = []

    def run(call: Call, deadline: float | None = None) -> Any:
        if inside:
            return real_run(call, deadline)
        try:
            raw = real_run(call, deadline)
        except BackendError as error:
            log.append((call, error))
            raise
        log.append((call, raw))
        return raw

    async def arun(call: Call, deadline: float | None = None) -> Any:
        inside.append(True)
        try:
            raw = await real_arun(call, deadline)
        except BackendError as error:
            log.append((call, error))
            raise
        finally:
            inside.pop()
        log.append((call, raw))
        return raw

    backend.run = run  # type: ignore[method-assign]
    backend.arun = arun  # type: ignore[method-assign]
    return log


def _answering(backend: RedisBackend, answers: Log) -> Log:
    """Make ``backend`` answer each call with the next of ``answers`` (whose call it
    must be: a mismatch is recorded as such); return the calls it was asked."""
    asked: Log = []

    def run(call: Call, deadline: float | None = None) -> Any:
        assert answers, f"a call the other path did not make: {call}"
        expected, answer = answers.pop(0)
        asked.append((call, answer))
        assert _same_call(call, expected), (call, expected)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def arun(call: Call, deadline: float | None = None) -> Any:
        return run(call, deadline)

    backend.run = run  # type: ignore[method-assign]
    backend.arun = arun  # type: ignore[method-assign]
    return asked


def _same_call(call: Call, expected: Call | None) -> bool:
    """The same script, KEYS and ARGV (None: any call, for scripted answers)."""
    return expected is None or (call.script, list(call.keys), list(call.args)) == (
        expected.script,
        list(expected.keys),
        list(expected.args),
    )


def _counts() -> dict[Any, float]:
    found = {("outcome", *key): counted[0] for key, counted in metrics._counts.outcomes.items()}
    found.update({("health", *key): counted[0] for key, counted in metrics._counts.health.items()})
    return found


def _delta(before: dict[Any, float]) -> dict[Any, float]:
    return {
        key: count - before.get(key, 0)
        for key, count in _counts().items()
        if count != before.get(key, 0)
    }


def _evaluate(engine: Limiter, policy: Policy, subject: Any, cost: Any, eid: Any) -> Any:
    """What ``evaluate()`` does on Redis; the outcome and whether it took the short path."""
    short = engine.shortcut(policy, subject, cost, eid, None)
    if short is not None:
        return engine.run_short(short), True
    return engine.run(engine.prepare([policy], subject, cost, evaluation_id=eid))[0], False


async def _aevaluate(engine: Limiter, policy: Policy, subject: Any, cost: Any, eid: Any) -> Any:
    short = engine.shortcut(policy, subject, cost, eid, None)
    if short is not None:
        return await engine.arun_short(short), True
    prepared = engine.prepare([policy], subject, cost, evaluation_id=eid)
    return (await engine.arun(prepared))[0], False


def _general(engine: Limiter, policy: Policy, subject: Any, cost: Any, eid: Any) -> Outcome:
    return engine.run(engine.prepare([policy], subject, cost, evaluation_id=eid))[0]


async def _ageneral(engine: Limiter, policy: Policy, subject: Any, cost: Any, eid: Any) -> Any:
    return (await engine.arun(engine.prepare([policy], subject, cost, evaluation_id=eid)))[0]


class Pair:
    """A short path's limiter and a general path's limiter, on the same settings."""

    def __init__(self, make: Callable[[], RedisBackend], **values: Any) -> None:
        settings = _settings(**values)
        self.short = Limiter(settings, make())
        self.general = Limiter(settings, make())
        assert self.short.scripted and self.general.scripted
        for engine in (self.short, self.general):
            if engine.fallback is not None:  # on one clock: both decide at the same ms
                engine.fallback = MemoryBackend(
                    1000, mode=BACKEND_MODE_FALLBACK, clock_ms=lambda: FIXED_REPLY_NOW
                )

    def close(self) -> None:
        self.short.close()
        self.general.close()

    def compare(
        self,
        ids: Ids,
        step: int,
        policy_id: str,
        subject: Any,
        cost: Any,
        eid: Any,
        *,
        asynchronous: bool,
        answers: Log | None = None,
    ) -> tuple[Outcome, bool]:
        """Decide one call on both limiters and assert they agree; the outcome and
        whether the short path was taken."""
        ids.step(step)
        policy = self.short.settings.policies[policy_id]
        log = (
            _recording(self.short.scripts)
            if answers is None  # type: ignore[arg-type]
            else _answering(self.short.scripts, list(answers))  # type: ignore[arg-type]
        )
        before = _counts()
        if asynchronous:
            got, took = asyncio.run(_aevaluate(self.short, policy, subject, cost, eid))
        else:
            got, took = _evaluate(self.short, policy, subject, cost, eid)
        counted = _delta(before)
        asked = _answering(self.general.scripts, list(log))  # type: ignore[arg-type]
        before = _counts()
        general = self.general.settings.policies[policy_id]
        if asynchronous:
            want = asyncio.run(_ageneral(self.general, general, subject, cost, eid))
        else:
            want = _general(self.general, general, subject, cost, eid)
        context = (step, policy_id, subject, cost, eid)
        assert got == want, context
        assert counted == _delta(before), context
        assert [call for call, _ in asked] == [call for call, _ in log], context
        assert [e.reason for e in self.short.recent_errors] == [
            e.reason for e in self.general.recent_errors
        ], context
        return got, took


def _fake() -> Callable[[], RedisBackend]:
    server = fakeredis.FakeServer()
    return lambda: fake_backend(server)


@pytest.fixture(params=["fakeredis", "redis"])
def backends(request: pytest.FixtureRequest) -> Iterator[tuple[Callable[[], RedisBackend], Any]]:
    """Backends of one server (fakeredis, or the session's redis-server), and a client."""
    if request.param == "fakeredis":
        make = _fake()
        yield make, None
        return
    url = request.getfixturevalue("redis_url")
    client = redis.Redis.from_url(url)
    yield (lambda: RedisBackend(url=url, timeout=1.0, max_inflight=8)), client
    client.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(3))
def test_the_short_path_makes_the_calls_and_outcomes_of_prepare_and_run(
    backends: Any, ids: Ids, seed: int, asynchronous: bool
) -> None:
    make, client = backends
    rng = random.Random(seed)
    # Each step opens a new event loop (a new connection) and may reload a flushed
    # script: a DEADLINE a loaded machine never reaches, so that only the replies differ.
    pair = Pair(make, TIMEOUT=1.0, DEADLINE=5.0)
    taken: set[str] = set()
    short_policies: set[str] = set()
    resumed = 0
    try:
        for step in range(300):
            if client is not None and rng.random() < 0.02:
                client.script_flush()  # NOSCRIPT, recovered below the short path
            policy_id = rng.choice(sorted(POLICIES))
            subject = rng.choice(SUBJECTS)
            cost = rng.choice([0, 1, 1, 1, 1, 2, 3, 7])
            eid = f"order-{rng.randrange(4)}" if rng.random() < 0.1 else None
            got, took = pair.compare(
                ids, step, policy_id, subject, cost, eid, asynchronous=asynchronous
            )
            if took:
                assert policy_id in SHORT and cost > 0 and eid is None
                taken.add(got.decision)
                short_policies.add(policy_id)
                resumed += got.decision != "allowed"
    finally:
        pair.close()
    assert taken == {"allowed", "denied", "shadow_denied"}
    assert {"two", "two_sliding"} <= short_policies
    assert resumed > 0


def _scripted(*answers: Any) -> Log:
    return [(None, answer) for answer in answers]  # type: ignore[misc]


def _unused() -> Callable[[], RedisBackend]:
    return lambda: RedisBackend(
        url="redis://short-path.invalid:6379/0", timeout=1.0, max_inflight=8
    )


FIXED_ONE = [0, FIXED_REPLY_NOW, 1]
FAILURES = {
    "a retry that succeeds": _scripted(BackendError(INDETERMINATE, "lost"), FIXED_ONE),
    "a retry that times out": _scripted(
        BackendError(INDETERMINATE, "lost"), BackendError(BACKEND_TIMEOUT, "slow")
    ),
    "unavailable": _scripted(BackendError(BACKEND_UNAVAILABLE, "refused")),
    "timeout": _scripted(BackendError(BACKEND_TIMEOUT, "slow")),
    "malformed": _scripted([b"what"]),
    "short": _scripted([0, FIXED_REPLY_NOW]),
    "undecided": _scripted([2]),
    "unknown status": _scripted([9, FIXED_REPLY_NOW, 1]),
    "refused": _scripted([0, FIXED_REPLY_NOW, 5]),
}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fallback", [False, True], ids=["no-fallback", "fallback"])
@pytest.mark.parametrize("case", sorted(FAILURES))
@pytest.mark.parametrize("policy_id", ["fixed", "open"])
def test_a_failure_or_another_reply_gives_the_general_paths_outcome(
    ids: Ids, case: str, policy_id: str, fallback: bool, asynchronous: bool
) -> None:
    pair = Pair(_unused(), LOCAL_FALLBACK={"ENABLED": fallback})
    try:
        got, took = pair.compare(
            ids,
            0,
            policy_id,
            {"ip": "203.0.113.7"},
            1,
            None,
            asynchronous=asynchronous,
            answers=FAILURES[case],
        )
    finally:
        pair.close()
    assert took
    if case == "a retry that succeeds":
        assert got.decision == "allowed"  # the reply: 1 used before this charge
        assert got.limit is not None and got.remaining == got.limit - 2
    elif case == "refused":
        assert got.decision == "denied"
    elif fallback and case in ("timeout", "unavailable"):
        assert (got.decision, got.backend_mode) == ("allowed", "fallback")
        assert got.limit is not None and got.remaining == got.limit - 1
    else:
        assert got.reason is not None and not got.reason.endswith("exhausted")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_an_open_breaker_and_a_remembered_refusal_as_the_general_path(
    ids: Ids, asynchronous: bool
) -> None:
    pair = Pair(_unused())
    subject = {"ip": "203.0.113.8"}
    try:
        # A refusal, remembered: the next call on that counter is answered without one.
        refused = pair.compare(
            ids,
            0,
            "fixed",
            subject,
            1,
            None,
            asynchronous=asynchronous,
            answers=_scripted([0, FIXED_REPLY_NOW, 5]),
        )[0]
        assert refused.decision == "denied"
        cached, took = pair.compare(
            ids, 1, "fixed", subject, 1, None, asynchronous=asynchronous, answers=[]
        )
        assert not took and cached.backend_mode == "cache"
        # Failures until the breaker opens: then no call at all.
        other = {"ip": "203.0.113.9"}
        for step in range(2, 7):
            pair.compare(
                ids,
                step,
                "fixed",
                other,
                1,
                None,
                asynchronous=asynchronous,
                answers=_scripted(BackendError(BACKEND_UNAVAILABLE, "down")),
            )
        opened, took = pair.compare(
            ids, 7, "fixed", other, 1, None, asynchronous=asynchronous, answers=[]
        )
        assert took and opened.decision == "failed_closed"
    finally:
        pair.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_stopped_redis_fails_both_paths_alike(ids: Ids, asynchronous: bool) -> None:
    from benchmarks.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    pair = Pair(lambda: RedisBackend(url=url, timeout=0.5, max_inflight=8))
    try:
        for step in range(3):
            got, took = pair.compare(
                ids, step, "fixed", {"ip": "203.0.113.1"}, 1, None, asynchronous=asynchronous
            )
            assert took and (got.decision, got.reason) == ("failed_closed", BACKEND_UNAVAILABLE)
    finally:
        pair.close()


def test_evaluate_and_aevaluate_take_it_on_redis(
    quota: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import django_quota

    quota(REDIS_URL=redis_url, POLICIES={"p": {"windows": "2/h", "selector": ["ip"]}})
    prepared = prepared_costs(monkeypatch)
    try:
        first = django_quota.evaluate("p", {"ip": "203.0.113.1"})
        second = asyncio.run(django_quota.aevaluate("p", {"ip": "203.0.113.1"}))
        assert prepared == []
        third = django_quota.evaluate("p", {"ip": "203.0.113.1"})  # refused: resumed
        fourth = django_quota.evaluate("p", {"ip": "203.0.113.1"}, cost=0)  # a peek
    finally:
        limiter.settings_changed()
    assert prepared == [0]
    assert [o.remaining for o in (first, second, third, fourth)] == [1, 0, 0, 0]
    assert third.decision == "denied" and first.backend_mode == "redis"
    assert len({first.evaluation_id, second.evaluation_id, third.evaluation_id}) == 3


def test_a_cluster_takes_prepare_and_run() -> None:
    from django_quota.backends.cluster import RedisClusterBackend

    settings = _settings(CLUSTER=True)
    backend = RedisClusterBackend(
        url="redis://short-path.invalid:7000/0", timeout=1.0, max_inflight=8
    )
    engine = Limiter(settings, backend)
    policy = engine.settings.policies["fixed"]
    assert not engine.scripted
    assert engine.shortcut(policy, {"ip": "203.0.113.1"}, 1, None, None) is None


def test_a_refusal_remembered_while_a_short_call_was_out_is_forgotten_as_by_run(
    ids: Ids,
) -> None:
    """Another evaluation's refusal of the counter, remembered while this call was on its
    way (the counter had none when it left): the call wrote the counter, so the refusal
    is forgotten, as ``steps`` forgets it for a prepared group."""
    pair = Pair(_unused())
    subject = {"ip": "203.0.113.10"}
    remembered = []
    try:
        for engine in (pair.short, pair.general):
            policy = engine.settings.policies["fixed"]
            answers = [[0, FIXED_REPLY_NOW, 5], FIXED_ONE]

            def run(
                call: Call,
                deadline: float | None = None,
                engine: Limiter = engine,
                answers: list[Any] = answers,
            ) -> Any:
                answer = answers.pop()
                if answers:  # the call on its way: another one is refused meanwhile
                    refused = _general(engine, engine.settings.policies["fixed"], subject, 1, None)
                    assert refused.decision == "denied"
                    remembered.append(len(engine.denied_counters))
                return answer

            engine.scripts.run = run  # type: ignore[method-assign]
            ids.step(0)
            if engine is pair.short:
                outcome, took = _evaluate(engine, policy, subject, 1, None)
                assert took
            else:
                outcome = _general(engine, policy, subject, 1, None)
            assert outcome.decision == "allowed"
            assert len(engine.denied_counters) == 0
    finally:
        pair.close()
    assert remembered == [1, 1]
