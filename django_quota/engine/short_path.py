"""The short paths: :func:`~django_quota.evaluate`'s common call decided without a
group, a request or a parsed reply (``docs/architecture.md``, "One decision").

The common call is one policy of a fixed window, sliding window counter or token bucket
without calendar windows (on the memory backend, with one window), an ``int`` cost above
0, the backend's clock, and no evaluation id or plan. It is keyed as
:meth:`~django_quota.engine.Limiter.prepare` keys it, and its outcome is built and
counted as :meth:`~django_quota.engine.Limiter.run` builds and counts it:

* on the memory backend (:meth:`ShortPath.shortcut` decides it), by
  :meth:`~django_quota.backends.memory.MemoryBackend.decide_call`, the model's rule;
* on Redis (standalone or Sentinel: :meth:`ShortPath.shortcut` makes the call, then
  :meth:`ShortPath.run_short` or :meth:`ShortPath.arun_short`), one script call through
  the node's bound and breaker; a reply that charged the call is read by
  :func:`~django_quota.core.protocol.charged_result` (the same rule
  :func:`~django_quota.core.protocol.parse_reply` applies), and anything else continues
  as the general plan, its first call answered with what the short call had.

:class:`ShortPath` is a base of the :class:`~django_quota.engine.Limiter`, which owns the
attributes and the methods declared here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, KeysView
from typing import TYPE_CHECKING, Any, NamedTuple

from django_quota import metrics
from django_quota.backends.memory import MemoryBackend
from django_quota.backends.scripting import Call, adrive, drive, evaluate_call
from django_quota.core.calls import GROUP_DECIDED, PolicyCall
from django_quota.core.errors import BackendError
from django_quota.core.evaluation_ids import entry_head
from django_quota.core.outcome import Outcome, outcome_from_result
from django_quota.core.policy import Policy
from django_quota.core.protocol import GroupRequest, charged_result, fingerprint
from django_quota.core.windows import new_tuple
from django_quota.engine.interpreting import Interpreter
from django_quota.engine.prepared import Compiled, Prepared, new_evaluation_id

__all__ = ["ShortCall", "ShortPath"]

Subject = Any  # a Mapping of dimensions to identities, as the engine's ``Subject``


def _given(answer: Any) -> Any:
    """A call's known answer: its raw reply, or its failure raised again."""
    if isinstance(answer, BackendError):
        raise answer
    return answer


class ShortCall(NamedTuple):
    """The common Redis call, ready to run without a :class:`Prepared` group
    (:meth:`ShortPath.shortcut`): the policy compiled, its counter key and call, the
    script call, the evaluation's fresh id and when it started."""

    compiled: Compiled
    counter: str
    call: PolicyCall
    script: Call
    evaluation_id: str
    started: float


class ShortPath(Interpreter):
    """The common call's short paths, for a :class:`~django_quota.engine.Limiter`."""

    local: bool
    #: A backend whose plan is one script call (Redis standalone or Sentinel).
    scripted: bool
    #: The memory backend, or a scripted one: the common call has a short path.
    shortcuts: bool
    local_backend: MemoryBackend
    clock: Callable[[], float] | None
    denied_counters: KeysView[str]
    dedup_ttl_ms: int
    cleanup_grace_ms: int

    if TYPE_CHECKING:  # the Limiter's own, which the short paths call

        def keyed(
            self, policy: Policy, subject: Subject, cost: int, plan: str | None, peek: bool
        ) -> tuple[Compiled, str | Outcome]: ...
        def execute(self, call: Any, started: float) -> Any: ...
        async def aexecute(self, call: Any, started: float) -> Any: ...
        def steps(self, prepared: Prepared) -> Generator[Any, Any, list[Outcome]]: ...
        def _recorded(self, prepared: Prepared, outcomes: list[Outcome]) -> list[Outcome]: ...
        def _observe_reply(self, status: int, started: float) -> None: ...
        def one_group(self, short: ShortCall) -> Prepared: ...

    def shortcut(
        self,
        policy: Policy,
        subject: Subject,
        cost: object,
        evaluation_id: str | None,
        plan: str | None,
    ) -> Outcome | ShortCall | None:
        """:func:`~django_quota.evaluate`'s common call without a group: on the memory
        backend its outcome, decided; on Redis standalone or Sentinel, its one script call
        ready to run (:meth:`run_short`, :meth:`arun_short`). None for any other call, an
        early outcome, a call that needs an id to undo it by (memory), a counter of a
        remembered refusal (the denial cache answers those), a cluster: prepare and run
        then decide it.

        The common call: ``cost`` an ``int > 0``, the backend's clock, no evaluation id or
        plan, no calendar window, a call whose charge
        :func:`~django_quota.core.protocol.charged_result` reads (Redis:
        :attr:`~django_quota.core.calls.PolicyCall.short_reply`) or that the model's
        ``decide_one`` decides (memory, one window:
        :attr:`~django_quota.core.calls.PolicyCall.short`), keyed as
        :meth:`~django_quota.engine.Limiter.prepare` keys it."""
        if evaluation_id is not None or plan is not None or self.clock is not None:
            return None
        if type(cost) is not int or cost <= 0 or not self.shortcuts:
            return None
        compiled, counter = self.keyed(policy, subject, cost, None, False)
        if type(counter) is not str or compiled.calendar:
            return None
        call = compiled.call(cost)
        if not self.local:
            if not call.short_reply or counter in self.denied_counters:
                return None
            return self._short_call(compiled, counter, call)
        if not call.short or compiled.needs_id:
            return None
        # Decided by MemoryBackend.decide_call (the model's decide_one), counted as run
        # counts it; a full backend leaves it to prepare and run.
        try:
            decided = self.local_backend.decide_call(
                counter, call, None, False, -1, self.cleanup_grace_ms, b"", self.dedup_ttl_ms
            )
        except BackendError:
            return None
        outcome = outcome_from_result(policy, decided.results[0], self.backend_mode, "")
        metrics.record_outcome(outcome, outcome.reason or "", compiled.selector_label)
        return outcome

    def _short_call(self, compiled: Compiled, counter: str, call: PolicyCall) -> ShortCall:
        """The common call's script call, as
        :func:`~django_quota.backends.scripting.evaluate_call` makes it, with a fresh
        evaluation id."""
        shape = compiled.short_calls.get(call.cost)
        if shape is None:
            shape = self._short_shape(compiled, counter, call)
        evaluation_id = new_evaluation_id()
        script = new_tuple(
            Call,
            (shape[0], (counter,), [entry_head(fingerprint(evaluation_id), call.cost), shape[1]]),
        )
        return new_tuple(
            ShortCall, (compiled, counter, call, script, evaluation_id, time.monotonic())
        )

    def _short_shape(self, compiled: Compiled, counter: str, call: PolicyCall) -> tuple[str, bytes]:
        """The script and packed arguments of ``call`` alone, the server's clock and no
        repeat, as :func:`~django_quota.backends.scripting.evaluate_call` makes them (the
        same for every counter and evaluation: remembered per cost)."""
        request = GroupRequest(
            (counter,), (call,), None, False, -1, self.dedup_ttl_ms, self.cleanup_grace_ms
        )
        made = evaluate_call(request)
        packed = made.args[1]  # after the fingerprint, which each evaluation has its own
        assert isinstance(packed, bytes)
        shape = (made.script, packed)
        if len(compiled.short_calls) < 16:
            compiled.short_calls[call.cost] = shape
        return shape

    def run_short(self, short: ShortCall) -> Outcome:
        """Run a :meth:`shortcut`'s call (sync): its one script call inside the node's bound
        and breaker (:meth:`execute`), its outcome built and counted as :meth:`run`
        builds and counts it. Any other turn (a failure, a refusal, a reply the short
        path does not read) continues as the general plan (:meth:`_resumed`)."""
        try:
            raw = self.execute(short.script, short.started)
        except BackendError as error:
            return self._resumed(short, error)
        outcome = self._short_outcome(short, raw)
        return self._resumed(short, raw) if outcome is None else outcome

    async def arun_short(self, short: ShortCall) -> Outcome:
        """Async twin of :meth:`run_short`."""
        try:
            raw = await self.aexecute(short.script, short.started)
        except BackendError as error:
            return await self._aresumed(short, error)
        outcome = self._short_outcome(short, raw)
        return await self._aresumed(short, raw) if outcome is None else outcome

    def _short_outcome(self, short: ShortCall, raw: Any) -> Outcome | None:
        """The outcome of a short call whose script charged it (:func:`charged_result`),
        observed, counted and logged as :meth:`steps` and :meth:`run` do; None for any
        other reply."""
        result = charged_result(raw, short.call)
        if result is None:
            return None
        if short.counter in self.denied_counters:
            self.forget_denials((short.counter,))  # as steps: the counter was written
        self._observe_reply(GROUP_DECIDED, short.started)
        compiled = short.compiled
        outcome = outcome_from_result(
            compiled.policy, result, self.backend_mode, short.evaluation_id
        )
        metrics.record_outcome(outcome, outcome.reason or "", compiled.selector_label)
        return outcome

    def _resumed(self, short: ShortCall, first: Any) -> Outcome:
        """A short call's evaluation continued as the general plan (:meth:`steps`): its
        first call is answered with the raw reply or failure the short call had
        (``first``), the calls after it run by :meth:`execute`."""
        prepared = self.one_group(short)
        started = short.started
        pending = [first]

        def run(call: Any) -> Any:
            return _given(pending.pop()) if pending else self.execute(call, started)

        return self._recorded(prepared, drive(self.steps(prepared), run))[0]

    async def _aresumed(self, short: ShortCall, first: Any) -> Outcome:
        """Async twin of :meth:`_resumed`."""
        prepared = self.one_group(short)
        started = short.started
        pending = [first]

        async def run(call: Any) -> Any:
            return _given(pending.pop()) if pending else await self.aexecute(call, started)

        return self._recorded(prepared, await adrive(self.steps(prepared), run))[0]
