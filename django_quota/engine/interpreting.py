"""Replies into outcomes: what the :class:`~django_quota.engine.Limiter` does with a
backend's reply or failure.

:class:`Interpreter` turns a reply into each policy's outcome, applies the failure modes
(``docs/failures.md``), decides with the local fallback when a failure allows, and keeps
the denial cache (refusals Redis gave, answered again without a call). The
:class:`~django_quota.engine.Limiter` is one: it owns the attributes declared here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import cast

from django_quota import conf
from django_quota.backends.memory import MemoryBackend
from django_quota.core.calls import (
    GROUP_CLOCK_UNSAFE,
    GROUP_INDETERMINATE,
    GROUP_REPLAYED,
    REFUSED,
    UNCHARGED,
    GroupResult,
)
from django_quota.core.denials import DenialCache, rememberable
from django_quota.core.errors import BackendError
from django_quota.core.log import logger
from django_quota.core.outcome import (
    BACKEND_MODE_CACHE,
    BACKEND_MODE_FALLBACK,
    BACKEND_MODE_REDIS,
    BACKEND_TIMEOUT,
    BACKEND_UNAVAILABLE,
    CLOCK_UNSAFE,
    FAILED_CLOSED,
    FAILED_OPEN,
    INDETERMINATE,
    Outcome,
    bare_outcome,
    outcome_from_result,
)
from django_quota.core.protocol import GroupReply, GroupRequest
from django_quota.engine.prepared import Prepared


class Interpreter:
    """Outcomes from replies and failures, and the denial cache, for a
    :class:`~django_quota.engine.Limiter`."""

    settings: conf.QuotaSettings
    backend_mode: str
    fallback: MemoryBackend | None
    denials: DenialCache | None

    def interpret(
        self, prepared: Prepared, reply: GroupReply | GroupResult, backend_mode: str
    ) -> list[Outcome]:
        """Turn a backend reply into outcomes (failure modes for a refused decision): a
        script's parsed reply, or the model's result (the memory backend and the local
        fallback), whose status and results are read alike."""
        status = reply.status
        if status == GROUP_CLOCK_UNSAFE:
            return self.failed(prepared, CLOCK_UNSAFE, backend_mode)
        if status == GROUP_INDETERMINATE:
            return self.failed(prepared, INDETERMINATE, backend_mode)
        outcomes = prepared.outcomes
        compiled = prepared.compiled
        evaluation_id = prepared.evaluation_id
        results = reply.results
        if len(outcomes) == 1 and len(results) == 1:  # one policy, sent: the common call
            result = results[0]
            policy = compiled[0].policy
            outcome = outcome_from_result(policy, result, backend_mode, evaluation_id)
            outcomes[0] = outcome
            if result.status == UNCHARGED and not (
                prepared.peek or status == GROUP_REPLAYED
            ):
                prepared.group_denied = (policy.id,)
            elif result.status == REFUSED and backend_mode == BACKEND_MODE_REDIS:
                self._remember_denial(prepared, reply)
            return [outcome]
        uncharged: list[str] = []
        refused = False
        for index, result in zip(prepared.sent, results, strict=True):
            policy = compiled[index].policy
            outcomes[index] = outcome_from_result(policy, result, backend_mode, evaluation_id)
            if result.status == UNCHARGED:
                uncharged.append(policy.id)
            elif result.status == REFUSED:
                refused = True
        if uncharged and not (prepared.peek or status == GROUP_REPLAYED):
            prepared.group_denied = tuple(uncharged)
        if refused and backend_mode == BACKEND_MODE_REDIS:
            self._remember_denial(prepared, reply)
        if len(outcomes) == len(prepared.sent):  # every policy decided by the backend
            return cast("list[Outcome]", outcomes.copy())
        return [outcome for outcome in outcomes if outcome is not None]

    # -- the denial cache ---------------------------------------------------------------
    def _remember_denial(self, prepared: Prepared, reply: GroupReply | GroupResult) -> None:
        """Remember a refusal Redis decided for the denial cache, when the group may be
        answered again (:func:`~django_quota.core.denials.rememberable`)."""
        denials = self.denials
        request = prepared.request
        if denials is None or request is None or prepared.peek:
            return
        shadow = any(compiled.policy.shadow for compiled in prepared.compiled)
        if rememberable(request, reply, shadow=shadow, cluster=self.settings.cluster):
            denials.remember(request, reply.results, prepared.started)

    def _cached(self, prepared: Prepared, request: GroupRequest) -> list[Outcome] | None:
        """The outcomes of a remembered refusal of ``request``'s group, when it tells
        them exactly now, else None. Never for a peek, nor for an evaluation that may
        repeat an earlier one (a caller's id): the backend's ledgers must be searched."""
        denials = self.denials
        if denials is None or prepared.peek or request.may_repeat:
            return None
        reply = denials.answer(request, time.monotonic())
        if reply is None:
            return None
        return self.interpret(prepared, reply, BACKEND_MODE_CACHE)

    def _written(self, request: GroupRequest) -> None:
        """Forget the refusals of every group holding a counter ``request`` wrote, or may
        have written (a failed call): their numbers are no longer those remembered."""
        if self.denials is not None and not request.peek:
            self.denials.forget(request.counters)

    def forget_denials(self, counters: Iterable[str]) -> None:
        """Forget every remembered refusal of a group holding one of ``counters`` (they
        were reset)."""
        if self.denials is not None:
            self.denials.forget(counters)

    def failed(self, prepared: Prepared, reason: str, backend_mode: str) -> list[Outcome]:
        """Apply each sent policy's failure mode for ``reason``."""
        logger.warning(
            "quota backend failure: reason=%s policies=%s",
            reason,
            ",".join(prepared.compiled[i].policy.id for i in prepared.sent),
        )
        retry_after = float(self.settings.failure_retry_after)
        for index in prepared.sent:
            compiled = prepared.compiled[index]
            if compiled.fail_open:
                outcome = bare_outcome(
                    compiled.policy,
                    FAILED_OPEN,
                    reason,
                    backend_mode=backend_mode,
                    evaluation_id=prepared.evaluation_id,
                )
            else:
                outcome = bare_outcome(
                    compiled.policy,
                    FAILED_CLOSED,
                    reason,
                    backend_mode=backend_mode,
                    evaluation_id=prepared.evaluation_id,
                    retry_after=retry_after,
                )
            prepared.outcomes[index] = outcome
        return [outcome for outcome in prepared.outcomes if outcome is not None]

    def degraded(self, prepared: Prepared, error: BackendError) -> list[Outcome]:
        """Decide with the local fallback when the failure allows, else apply the failure
        modes."""
        request = prepared.request
        reasons = (BACKEND_TIMEOUT, BACKEND_UNAVAILABLE)  # the failures the fallback decides
        if self.fallback is not None and error.reason in reasons and request:
            logger.warning("quota backend failure, deciding locally: reason=%s", error.reason)
            try:
                reply = self.fallback.decide(request._replace(may_repeat=False))
            except BackendError as fallback_error:
                return self.failed(prepared, fallback_error.reason, BACKEND_MODE_FALLBACK)
            return self.interpret(prepared, reply, BACKEND_MODE_FALLBACK)
        return self.failed(prepared, error.reason, self.backend_mode)
