"""The Redis Cluster backend (``QUOTA["CLUSTER"] = True``, ``docs/cluster.md``).

The scripts of the standalone backend run on the primary of each key's hash slot. A
counter key (which holds its own evaluation-id ledger) and a sliding log's lists share
the identity's ``{hash tag}``, so one policy is always one slot, and the policies
selecting one subject share a slot; a group is split by slot and decided one slot at a
time (:func:`plan`), with refunds when a later slot refuses (best effort).

Retries are off at both levels of redis-py's cluster client: ``retry=Retry(NoBackoff(),
0)`` is the cluster client's own retry (what ``cluster_error_retry_attempts`` used to
set; it re-sends a command after a timeout or a lost connection), and redis-py builds
every node's connections with ``Retry(NoBackoff(), 0)`` itself. ``MOVED``/``ASK``
redirections are still followed: a redirected command did not run.

**Connect or write?** The failure reasons (``docs/failures.md``) need the two apart
(:func:`classify_cluster`):

* sync: every node of ``redis.cluster.RedisCluster`` has a redis-py connection pool, and
  ``connection_pool_class`` picks its class (with ``from_url``), so each node gets the
  standalone backend's :class:`~django_quota.backends.redis.MarkingConnectionPool`: a
  failure inside ``get_connection`` (connect, handshake, a pooled connection found
  closed, a full pool) is :class:`~django_quota.backends.failures.ConnectFailed`, raised
  before ``EVALSHA`` is written;
* asyncio: ``redis.asyncio.cluster.RedisCluster`` nodes keep bare connections (no pool
  class to choose), so the fence
  (:func:`~django_quota.backends.redispy.fence_async_cluster`) swaps the client's
  ``connection_class`` for one that does what the pool does, right before a command is
  written: a pooled connection the server closed is dropped, a new one is connected
  with its handshake, and any failure there is ``ConnectFailed``. A full node
  (``MaxConnectionsError``) is raised before the write too. On redis-py's public path
  (``REDIS_PUBLIC_PATH``) async calls run on the sync client in a worker thread instead.

Everything after that is ``indeterminate``, as on a standalone Redis. Cluster refusals
(``CLUSTERDOWN``, ``TRYAGAIN``, redirections past redis-py's 16 hops, a slot no node
serves) ran nothing: ``backend_unavailable``; ``CLUSTERDOWN`` and ``TRYAGAIN`` are
labelled and never counted by a breaker (the node answered). When redis-py's topology
refresh fails while it handles a command's error, the command's own error decides.

The sync backend sends its commands straight to the slot's primary
(:meth:`RedisClusterBackend.run`): redis-py's cluster client sleeps 0.25 s before it
raises ``CLUSTERDOWN``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis import exceptions as redis_exceptions
from redis.asyncio import cluster as async_cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot

from django_quota.backends.clients import BaseRedisBackend, text
from django_quota.backends.failures import CONNECT_ERRORS, ConnectFailed, classify
from django_quota.backends.redis import (
    MarkingConnectionPool,
    PublicMarkingConnectionPool,
    pinned_url,
    send,
)
from django_quota.backends.redispy import fence_async_cluster
from django_quota.backends.scripting import (
    Call,
    Plan,
    arun_script,
    evaluate_call,
    parse,
    run_script,
)
from django_quota.core.calls import (
    ALGORITHM_CODES,
    CHARGED,
    GROUP_CLOCK_UNSAFE,
    GROUP_INDETERMINATE,
    GROUP_REPLAYED,
    REFUSED,
    UNCHARGED,
    Packing,
    PolicyCall,
    PolicyResult,
)
from django_quota.core.errors import BackendError, Blame, Label
from django_quota.core.log import logger
from django_quota.core.model import group_allows
from django_quota.core.outcome import (
    BACKEND_ERROR,
    BACKEND_TIMEOUT,
    BACKEND_UNAVAILABLE,
    INDETERMINATE,
)
from django_quota.core.policy import CONCURRENCY, FIXED_WINDOW, SLIDING_LOG, TOKEN_BUCKET, Window
from django_quota.core.protocol import GroupReply, GroupRequest, ReleaseRequest, log_key
from django_quota.core.refunds import RefundMode, RefundRequest
from django_quota.core.windows import calendar_place


def classify_cluster(exc: BaseException) -> BackendError:
    """Map a redis-py cluster client exception to its failure reason (``docs/failures.md``).

    Cluster refusals (``CLUSTERDOWN``, ``TRYAGAIN``, ``MOVED``/``ASK`` past the hop limit,
    an uncovered slot, a full node) are ``backend_unavailable``: nothing ran. A
    ``RedisClusterException`` raised by a topology refresh while redis-py handled a
    command's failure is classified by that failure (its ``__context__``); one raised
    while connecting the client (no command sent) is ``backend_timeout`` or
    ``backend_unavailable`` by its cause, else ``backend_error`` (a configuration
    mistake such as a standalone server behind ``CLUSTER``). The rest is :func:`classify`.

    ``CLUSTERDOWN`` and ``TRYAGAIN`` are labelled as such, and never count toward the
    breaker of the node that answered them: its connections work.
    """
    message = f"{type(exc).__name__}: {exc}"
    # The node answered: labelled, never counted by its breaker (docs/failures.md).
    if isinstance(exc, redis_exceptions.ClusterDownError):
        return BackendError(BACKEND_UNAVAILABLE, message, label=Label.CLUSTERDOWN, blame=Blame.NONE)
    if isinstance(exc, redis_exceptions.TryAgainError):
        return BackendError(BACKEND_UNAVAILABLE, message, label=Label.TRYAGAIN, blame=Blame.NONE)
    not_run = (  # refusals of the cluster itself: the command did not run
        redis_exceptions.ClusterError,  # CLUSTERDOWN; "TTL exhausted" after 16 redirections
        redis_exceptions.TryAgainError,
        redis_exceptions.AskError,  # and MovedError
        redis_exceptions.SlotNotCoveredError,
        redis_exceptions.MaxConnectionsError,
    )
    if isinstance(exc, not_run):
        return BackendError(BACKEND_UNAVAILABLE, message)
    if isinstance(exc, redis_exceptions.RedisClusterException):
        context = exc.__context__
        if isinstance(context, Exception) and context is not exc.__cause__:
            return classify_cluster(context)
        cause = exc.__cause__
        if isinstance(cause, CONNECT_ERRORS):
            if isinstance(cause, ConnectFailed):
                timed_out = cause.timed_out
            else:
                timed_out = isinstance(cause, (redis_exceptions.TimeoutError, TimeoutError))
            return BackendError(BACKEND_TIMEOUT if timed_out else BACKEND_UNAVAILABLE, message)
        return BackendError(BACKEND_ERROR, message)
    return classify(exc)


# -- one group, slot by slot ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Slice:
    """The policies of a group that share one hash slot (``indexes`` into the group, in
    order) and the request deciding them atomically."""

    indexes: tuple[int, ...]
    request: GroupRequest


def split_by_slot(request: GroupRequest, slot_of: Callable[[str], int]) -> list[Slice]:
    """Group ``request``'s policies by the slot of their counter key, in the order of
    each slot's first policy, keeping policy order inside each slice."""
    by_slot: dict[int, list[int]] = {}
    for index, counter in enumerate(request.counters):
        by_slot.setdefault(slot_of(counter), []).append(index)
    return [
        Slice(
            tuple(indexes),
            request._replace(
                counters=tuple(request.counters[i] for i in indexes),
                calls=tuple(request.calls[i] for i in indexes),
            ),
        )
        for indexes in by_slot.values()
    ]


#: Always denies (cost 2 > limit 1, whatever its never-written counter holds), so the
#: policies of a slice decided after a refusal are computed at their real cost and
#: charged nothing: evaluate.lua charges nothing when an enforced policy denies.
_VETO = PolicyCall(FIXED_WINDOW, (Window("veto", 1, 1000, 1),), cost=2, enforce=True)


def dry_run(request: GroupRequest) -> GroupRequest:
    """``request`` plus a veto: every policy's own decision, nothing charged.

    The veto's counter carries the slice's hash tag (it extends the slice's first
    counter's name); it is only ever read, never written: a denial writes nothing.
    """
    return request._replace(
        counters=(*request.counters, f"{request.counters[0]}:veto"),
        calls=(*request.calls, _VETO),
    )


def refund_call(request: GroupRequest, results: Sequence[PolicyResult]) -> Call | None:
    """The ``refund.lua`` call giving back what ``results`` charged (None: nothing), and
    removing the evaluation's fingerprint from those counters' ledgers. A sliding log's
    lists follow the counters in KEYS, as for ``evaluate.lua``."""
    keys: list[str] = []
    logs: list[str] = []
    args: list[int | bytes] = [0, request.fingerprint, RefundMode.BEST_EFFORT, 0]
    for counter, call, result in zip(request.counters, request.calls, results, strict=True):
        if result.status != CHARGED or call.algorithm == CONCURRENCY:  # release_calls
            continue
        keys.append(counter)
        if call.algorithm == SLIDING_LOG:
            logs += [log_key(counter, index) for index in range(1, len(call.windows) + 1)]
        if call.bounds:  # a calendar call: each window's start and end at the charge
            args += [Packing.CALENDAR_CODE, call.cost, result.now_ms, len(call.windows)]
            for index, window in enumerate(call.windows):
                start, end = calendar_place(call.bounds, index, result.now_ms, window.period_ms)
                args += [window.period_ms, start, end]
            continue
        args += [ALGORITHM_CODES[call.algorithm], call.cost, result.now_ms, len(call.windows)]
        for window in call.windows:
            args += [window.period_ms, window.limit if call.algorithm == TOKEN_BUCKET else 0, 0]
    if not keys:
        return None
    args[0] = len(keys)
    return Call("refund", keys + logs, args)


def refund_calls(request: RefundRequest) -> list[Call]:
    """The ``refund.lua`` calls of an at-most-once refund: one per hash slot of its
    counters (policies selecting the same subject share one)."""
    by_slot: dict[int, list[int]] = {}
    for index, counter in enumerate(request.counters):
        by_slot.setdefault(slot_of(counter), []).append(index)
    parts = [request.part(indexes) for indexes in by_slot.values()]
    return [Call("refund", part.keys(), part.args()) for part in parts]


def release_calls(request: GroupRequest, results: Sequence[PolicyResult]) -> list[Call]:
    """The ``release.lua`` calls freeing the leases ``results`` acquired (one per
    concurrency policy charged), at the ``now`` each was acquired at."""
    return [
        Call(
            "release",
            (counter,),
            ReleaseRequest(
                counter, request.fingerprint, result.now_ms, request.cleanup_grace_ms
            ).args(),
        )
        for counter, call, result in zip(request.counters, request.calls, results, strict=True)
        if result.status == CHARGED and call.algorithm == CONCURRENCY
    ]


def uncharged(call: PolicyCall, result: PolicyResult) -> PolicyResult:
    """``result`` as reported after its charge was refunded: status
    :data:`UNCHARGED`, each window's ``remaining`` plus the cost, capped at the
    window's limit (the token bucket's capacity). Best effort: the other numbers stay
    those of the charged state."""
    if result.status != CHARGED:
        return result
    windows = tuple(
        numbers._replace(
            remaining=min(
                window.capacity if call.algorithm == TOKEN_BUCKET else window.limit,
                numbers.remaining + call.cost,
            ),
        )
        for window, numbers in zip(call.windows, result.windows, strict=True)
    )
    return PolicyResult(UNCHARGED, result.now_ms, windows)


def plan(request: GroupRequest, slices: Sequence[Slice]) -> Plan:
    """Decide ``request`` slice by slice; yields each :class:`Call` and receives its raw
    reply (a failure is thrown in as :class:`BackendError`). Returns the group's reply.

    * Slices run in order, each one ``EVALSHA`` (atomic within its slot).
    * Once an enforced policy denies, the later slices run as :func:`dry_run`s (their
      outcomes at the real cost, nothing charged), and the charges of the earlier slices
      are refunded (:func:`refund_call`); their results become :func:`uncharged`. A
      refund that fails is logged, and its results keep their charge.
    * A ``clock_unsafe`` slice refunds the earlier charges and makes the group
      ``clock_unsafe``, as one script would. An ``indeterminate`` slice (a retry whose
      ledger entry may have been dropped) makes the group ``indeterminate``, keeping the
      earlier charges: it may have consumed.
    * A slice replaying an earlier attempt of the same evaluation reports the policies
      that attempt charged as charged, so that a later refusal refunds them once.
    * A failed call fails the group. ``indeterminate`` keeps the earlier charges: the
      limiter's retry, with the same evaluation id, replays every slice that charged
      (the counters' ledgers hold its id) and refunds at most once. Any other failure ran nothing in
      its slot, so the earlier charges are refunded first.
    """
    if len(slices) == 1:
        return parse((yield evaluate_call(request)), request)
    results: list[PolicyResult | None] = [None] * len(request.calls)
    charged: list[tuple[Slice, tuple[PolicyResult, ...]]] = []
    refused = False
    replayed = True
    for part in slices:
        sub = dry_run(part.request) if refused and not request.peek else part.request
        try:
            reply = parse((yield evaluate_call(sub)), sub)
        except BackendError as error:
            if error.reason != INDETERMINATE:
                yield from _refund(charged)
            raise error
        if reply.clock_unsafe:
            yield from _refund(charged)
            return GroupReply(GROUP_CLOCK_UNSAFE, ())
        if reply.indeterminate:
            return GroupReply(GROUP_INDETERMINATE, ())
        own = reply.results[: len(part.indexes)]
        replayed = replayed and reply.replayed
        for index, result in zip(part.indexes, own, strict=True):
            results[index] = result
        if any(result.status == CHARGED for result in own):
            charged.append((part, own))
        if not group_allows(part.request.calls, [result.status != REFUSED for result in own]):
            refused = True
    if refused:
        for part, own in (yield from _refund(charged)):
            for index, call, result in zip(part.indexes, part.request.calls, own, strict=True):
                results[index] = uncharged(call, result)
    assert all(result is not None for result in results)
    status = GROUP_REPLAYED if replayed else 0
    return GroupReply(status, tuple(r for r in results if r is not None))


def _refund(
    charged: Sequence[tuple[Slice, tuple[PolicyResult, ...]]],
) -> Generator[Call, Any, list[tuple[Slice, tuple[PolicyResult, ...]]]]:
    """Refund each charged slice (one call each); return those refunded. Failures are
    logged, never raised."""
    done = []
    for part, own in charged:
        releases = release_calls(part.request, own)
        for release in releases:  # a concurrency policy's lease, freed (docs/concurrency.md)
            try:
                yield release
            except BackendError as error:
                logger.warning(
                    "quota cluster release failed, the lease frees itself after its period: "
                    "reason=%s",
                    error.reason,
                )
        call = refund_call(part.request, own)
        if call is None:
            if releases:
                done.append((part, own))
            continue
        try:
            yield call
        except BackendError as error:
            logger.warning(
                "quota cluster refund failed, the charge stays: reason=%s policies=%d",
                error.reason,
                len(call.keys),
            )
            continue
        done.append((part, own))
    return done


def slot_of(key: str) -> int:
    """The Redis Cluster hash slot of ``key`` (CRC16 of its ``{hash tag}``)."""
    return int(key_slot(key.encode()))


# -- the backend ------------------------------------------------------------------------------
class RedisClusterBackend(BaseRedisBackend):
    """Counters in a Redis Cluster (``QUOTA["CLUSTER"]``), same interface as
    :class:`~django_quota.backends.redis.RedisBackend`.

    ``url`` names any node (``redis://`` or ``rediss://``; the client discovers the
    others). Clients are kept as
    :class:`~django_quota.backends.clients.BaseRedisBackend` says; the sync client
    connects when created, so a cluster that cannot be reached is a failure of that call,
    and the next call tries again.
    """

    clustered = True
    classify = staticmethod(classify_cluster)

    def __init__(
        self,
        *,
        url: str,
        timeout: float,
        max_inflight: int,
        url_options: Mapping[str, Any] | None = None,
        public: bool = False,
    ) -> None:
        super().__init__(
            timeout=timeout, max_inflight=max_inflight, url_options=url_options, public=public
        )
        self.url = pinned_url(url)
        #: Primaries (``host:port``) whose last direct call failed to connect or read:
        #: their calls go through redis-py's cluster client until one succeeds.
        self._suspects: set[str] = set()

    # -- clients -----------------------------------------------------------------------
    def _build(self, asynchronous: bool) -> Any:
        if not asynchronous:
            pool_class = PublicMarkingConnectionPool if self.public else MarkingConnectionPool
            return RedisCluster.from_url(
                self.url, connection_pool_class=pool_class, **self._options()
            )
        known = self._known_nodes()
        options = {**self._options(), "retry": AsyncRetry(NoBackoff(), 0)}
        client = async_cluster.RedisCluster.from_url(self.url, **options)
        fence_async_cluster(client, known)
        return client

    def _known_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node the clients have learnt, in no particular order."""
        known: dict[str, tuple[str, int]] = {}
        for client in (self._client, *self._async_clients.values()):
            if client is not None:
                for node in client.get_nodes():
                    known[node.name] = (node.host, int(node.port))
        return list(known.values())

    # -- script calls ------------------------------------------------------------------
    def node_of(self, call: Call) -> str:
        """The primary (``host:port``) serving the slot of the call's keys, as the clients'
        slot tables know it (no I/O); ``"cluster"`` before any client has learnt them.
        The limiter keeps one circuit breaker and in-flight bound per name, so a dead
        primary fails only its own slots."""
        key = call.keys[0]
        for client in (self._client, *self._async_clients.values()):
            if client is None:
                continue
            try:
                return str(client.get_node_from_key(key).name)
            except redis_exceptions.SlotNotCoveredError:  # not learnt yet
                continue
        return "cluster"

    def plan(self, request: GroupRequest) -> Plan:
        """One ``EVALSHA`` per hash slot, in order, with refunds (:func:`plan`)."""
        return plan(request, split_by_slot(request, slot_of))

    def refund(self, request: RefundRequest) -> int:
        """Run ``refund.lua`` once per hash slot of the request's counters, each on the
        primary serving it; the units refunded."""
        return sum(int(self.run(call)) for call in refund_calls(request))

    async def arefund(self, request: RefundRequest) -> int:
        """Async twin of :meth:`refund`."""
        return sum([int(await self.arun(call)) for call in refund_calls(request)])

    def run(self, call: Call, deadline: float | None = None) -> Any:
        """Run one script call on the primary of its slot. ``NOSCRIPT`` loads the script
        on that primary only (redis-py's ``Script`` would load it on every primary, tying
        this call to the health of the whole cluster) and runs it again.

        The commands go straight to the slot's primary, on its redis-py pool
        (``get_node_from_key``, ``get_redis_connection``): redis-py's cluster client
        sleeps 0.25 s before it raises ``CLUSTERDOWN``, longer than the whole default
        ``DEADLINE``, and no setting turns that off. A ``MOVED`` or ``ASK`` reply (the
        command did not run) is sent again through the cluster client, which follows it
        and learns the new owner. After a connection failure the node is suspect: its
        calls go through the cluster client, which rereads the slot table on its own
        connection failures (a failover), until one succeeds (docs/cluster.md). Each
        direct command is bounded by ``deadline`` as the standalone backend's are
        (:func:`~django_quota.backends.redis.send`)."""
        source = self._sources[call.script]
        timeout = self.timeout
        fast = not self.public
        try:
            client = self.client
            try:
                node = client.get_node_from_key(call.keys[0])
            except redis_exceptions.SlotNotCoveredError:  # redis-py rereads the table
                return run_script(source, call, self._routed(client, call))
            name = node.name
            if name in self._suspects:
                reply = run_script(source, call, self._routed(client, call))
                self._suspects.discard(name)
                return reply
            pool = client.get_redis_connection(node).connection_pool
            routed = self._routed(client, call)

            def execute(command: tuple[Any, ...]) -> Any:
                try:
                    return send(pool, command, deadline, timeout, fast)
                except redis_exceptions.AskError:  # and MovedError: it did not run
                    return routed(command)

            try:
                return run_script(source, call, execute)
            except CONNECT_ERRORS:
                self._suspects.add(name)
                raise
        except Exception as exc:
            raise classify_cluster(exc) from exc

    @staticmethod
    def _routed(client: Any, call: Call) -> Callable[[tuple[Any, ...]], Any]:
        """Send a command of ``call`` through redis-py's cluster client (``EVALSHA``
        routed by its key, ``SCRIPT LOAD`` to the primary of the call's slot)."""

        def execute(command: tuple[Any, ...]) -> Any:
            if command[0] == "EVALSHA":
                return client.execute_command(*command)
            node = client.get_node_from_key(call.keys[0])
            name = " ".join(command[:2])
            return client.execute_command(name, *command[2:], target_nodes=node)

        return execute

    async def arun(self, call: Call, deadline: float | None = None) -> Any:
        """Async twin of :meth:`run`: on the loop's asyncio cluster client, or, on
        redis-py's public path (``docs/settings.md``, ``REDIS_PUBLIC_PATH``), on :meth:`run`
        in a worker thread (the asyncio client tells connect failures apart only through
        the fence). ``deadline`` bounds the worker thread's commands; the asyncio cluster
        client's are bounded by ``TIMEOUT`` each (docs/settings.md, "Time budgets")."""
        if self.public:
            return await self.in_thread(asyncio.get_running_loop(), None, call, deadline)
        source = self._sources[call.script]
        try:
            client = self._async()
            # A new client routes its first command before it has learnt the slots, to a
            # random primary (redis-py): a dead one fails it, a live one answers MOVED.
            # Initialized first, it asks its startup nodes (a no-op once it is).
            await client.initialize()

            async def execute(command: tuple[Any, ...]) -> Any:
                if command[0] == "EVALSHA":
                    return await client.execute_command(*command)
                node = client.get_node_from_key(call.keys[0])
                return await client.execute_command(
                    " ".join(command[:2]), *command[2:], target_nodes=node
                )

            return await arun_script(source, call, execute)
        except Exception as exc:
            raise classify_cluster(exc) from exc

    def preload(self) -> list[tuple[str, str]]:
        """``SCRIPT LOAD`` every script on every primary; return (name, SHA1) pairs."""
        loaded = []
        try:
            client = self.client
            primaries = client.get_primaries()
            for source in self._sources.values():
                for node in primaries:
                    sha = client.execute_command("SCRIPT LOAD", source.source, target_nodes=node)
                    if text(sha) != source.sha1:
                        raise BackendError(
                            BACKEND_ERROR, f"{node.name} loaded {source.name} as {text(sha)}"
                        )
                loaded.append((source.name, source.sha1))
        except BackendError:
            raise
        except Exception as exc:
            raise classify_cluster(exc) from exc
        return loaded

    # -- quota check -------------------------------------------------------------------
    def primaries(self) -> list[Any]:
        """Every primary of the cluster (``quota check`` asks each)."""
        return list(self.client.get_primaries())

    def command(self, node: Any, *command: Any) -> Any:
        """Send ``command`` to the primary ``node``; its parsed reply."""
        return self.client.execute_command(*command, target_nodes=node)
