"""The checks: each client's responses against the replay of the fixed-window arithmetic
(statuses, Retry-After, headers, bodies, the shadow policy's reported decisions), and the
workers' decision counters against the replay's."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from example_project.demo.policies import Policy
from example_project.demo.replay import (
    ALLOWED,
    DENIED,
    SHADOW_DENIED,
    Replay,
    State,
    boundaries_within,
    retry_after_header,
)
from example_project.demo.scenario import Surface
from example_project.demo.traffic import Client, Sample

QUOTA_EXCEEDED_TYPE = "https://iana.org/assignments/http-problem-types#quota-exceeded"
DRF_THROTTLED_PREFIX = "Request was throttled"
#: The replay paths kept after each request (the ones with the fewest mismatches).
MAX_BRANCHES = 512


@dataclass(frozen=True, slots=True)
class Branch:
    states: tuple[State, ...]
    charged: tuple[int, ...]
    """Per policy: requests charged so far (the server's ``allowed`` outcomes)."""
    refused: tuple[int, ...]
    """Per policy: ``denied`` or ``shadow_denied`` outcomes so far."""
    admitted: int
    mismatches: int


@dataclass(slots=True)
class Verdict:
    sent: int = 0
    successes: int = 0
    denied: int = 0
    first_retry_after: str | None = None
    admitted: int = 0
    expected: int = 0
    ambiguous: int = 0
    decision_mismatches: int = 0
    bad_statuses: dict[str, int] = field(default_factory=dict)
    bad_429s: int = 0
    bad_retry_after: int = 0
    bad_headers: int = 0
    shadow_refusals: int = 0
    shadow_unreported: int = 0
    crashed: str | None = None
    unknown: int = 0
    """Requests whose outcome the client does not know (transport errors, odd statuses)."""
    charged: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per policy: the (fewest, most) ``allowed`` outcomes of the paths that explain
    every response (one number unless requests were ambiguous)."""
    refused: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per policy: likewise for ``denied``/``shadow_denied`` outcomes."""
    reported: dict[str, int] = field(default_factory=dict)
    """Per shadow policy: the ``shadow_denied`` decisions the view reported."""

    @property
    def ok(self) -> bool:
        return not (
            self.decision_mismatches
            or self.bad_statuses
            or self.bad_429s
            or self.bad_retry_after
            or self.bad_headers
            or self.shadow_refusals
            or self.shadow_unreported
            or self.crashed
            or self.admitted != self.expected
        )

    def problems(self) -> list[str]:
        found: list[str] = []
        if self.admitted != self.expected:
            found.append(f"admitted {self.admitted}, expected {self.expected}")
        if self.decision_mismatches:
            found.append(f"{self.decision_mismatches} decision(s) differ from the replay")
        for status, n in sorted(self.bad_statuses.items()):
            found.append(f"{n} response(s) with status {status}")
        if self.bad_429s:
            found.append(f"{self.bad_429s} 429(s) without Retry-After or the surface's body")
        if self.bad_retry_after:
            found.append(f"{self.bad_retry_after} Retry-After value(s) off the fixed window")
        if self.bad_headers:
            found.append(f"{self.bad_headers} response(s) with wrong RateLimit-Policy headers")
        if self.shadow_refusals:
            found.append(f"{self.shadow_refusals} 429(s) on a route only a shadow policy limits")
        if self.shadow_unreported:
            found.append(f"{self.shadow_unreported} response(s) without the shadow decision")
        if self.crashed:
            found.append(f"client crashed: {self.crashed}")
        return found


@dataclass(frozen=True, slots=True)
class Observation:
    """What one response says, and when the server may have decided it."""

    sample: Sample
    allowed: bool
    """It answered the endpoint's success status: every layer admitted it."""
    decided: bool
    """It answered the success status or 429; otherwise its fate is unknown."""
    shadow: dict[int, str]
    """Per index of a shadow policy in the replay: the decision the view reported."""
    straddles: bool
    """Its [send, receive] interval straddles a window boundary."""
    plans: list[tuple[int, ...]]
    """Per window assignment the server may have made: the time each layer decided at."""


def span(lo: int, hi: int) -> str:
    """Format a count the replay expects: ``lo``, or ``lo..hi`` when requests were ambiguous."""
    return str(lo) if lo == hi else f"{lo}..{hi}"


def judge_all(known: Mapping[str, Policy], clients: Sequence[Client]) -> dict[str, Verdict]:
    """Judge every client, by name."""
    return {client.spec.name: judge(known, client) for client in clients}


def client_problems(clients: Sequence[Client], verdicts: Mapping[str, Verdict]) -> list[str]:
    """List every client's problems, each prefixed with the client's name."""
    return [
        f"{client.spec.name}: {problem}"
        for client in clients
        for problem in verdicts[client.spec.name].problems()
    ]


def judge(known: Mapping[str, Policy], client: Client) -> Verdict:
    """Replay a client's requests through its layers' windows and compare the outcomes."""
    replay = Replay.of(client.spec, known)
    policy_header = expected_policy_header(replay)
    verdict = Verdict(sent=len(client.samples), crashed=client.crashed)
    verdict.reported = {p.id: 0 for p in replay.policies if p.shadow}
    zeros = tuple(0 for _ in replay.policies)
    branches = {Branch(replay.initial(), zeros, zeros, 0, 0)}
    for sample in client.samples:
        tally(client.spec.surface, replay, policy_header, sample, verdict)
        seen = observe(replay, sample)
        verdict.ambiguous += seen.straddles
        if seen.decided and not seen.straddles:
            check_retry_after(replay, branches, sample, verdict)
        branches = advance(replay, branches, seen)
    settle(replay, branches, verdict)
    return verdict


def tally(
    surface: Surface, replay: Replay, policy_header: str | None, sample: Sample, verdict: Verdict
) -> None:
    """Count what the client saw of one response: its status, its 429 body, its
    rate-limit headers and the shadow decisions the view reported."""
    allowed = sample.status == sample.action.success
    denied = sample.status == 429
    if allowed:
        verdict.successes += 1
    elif denied:
        verdict.denied += 1
        if verdict.first_retry_after is None:
            verdict.first_retry_after = sample.retry_after or "-"
        if surface.refusal is None:
            verdict.shadow_refusals += 1
        elif not check_refusal_body(surface, replay, sample):
            verdict.bad_429s += 1
    else:
        verdict.unknown += 1
        key = str(sample.status) if sample.status else f"error ({sample.error})"
        verdict.bad_statuses[key] = verdict.bad_statuses.get(key, 0) + 1
    if (allowed or denied) and (
        sample.ratelimit_policy != policy_header
        or (policy_header is None and sample.ratelimit is not None)
    ):
        verdict.bad_headers += 1
    if allowed:
        reported = dict(sample.decisions or ())
        for policy in replay.policies:
            if not policy.shadow:
                continue
            if policy.id in reported:
                verdict.reported[policy.id] += reported[policy.id] == SHADOW_DENIED
            else:
                verdict.shadow_unreported += 1


def observe(replay: Replay, sample: Sample) -> Observation:
    """Read what a response tells the replay: the status, the shadow decisions the view
    reported (the catalog does), and the times at which its layers may have decided."""
    allowed = sample.status == sample.action.success
    reported = dict(sample.decisions or ()) if allowed else {}
    shadow = {
        i: reported[p.id] for i, p in enumerate(replay.policies) if p.shadow and p.id in reported
    }
    windows = replay.windows
    straddles = any(w.start(sample.send_ms) != w.start(sample.recv_ms) for w in windows)
    if straddles:
        # Each stretch of [send, recv] between two boundaries is one window
        # assignment; the layers decide in order, so their times never decrease.
        times = [sample.send_ms, *boundaries_within(windows, sample.send_ms, sample.recv_ms)]
        plans = list(itertools.combinations_with_replacement(times, len(replay.layers)))
    else:
        plans = [tuple(sample.send_ms for _ in replay.layers)]
    decided = allowed or sample.status == 429
    return Observation(sample, allowed, decided, shadow, straddles, plans)


def advance(replay: Replay, branches: set[Branch], seen: Observation) -> set[Branch]:
    """Follow every replay path through one more request, keeping those that explain
    its response best."""
    successors: set[Branch] = set()
    for branch in branches:
        options = [follow(replay, branch, plan, seen) for plan in seen.plans]
        if seen.decided and seen.straddles:
            # The server read its clock somewhere in [send, recv]: keep the
            # assignments that explain what it answered.
            fewest = min(o.mismatches for o in options)
            options = [o for o in options if o.mismatches == fewest]
        if not seen.decided:
            # A transport error or an odd status: it may not have been decided at all.
            options.append(branch)
        successors.update(options)
    return set(sorted(successors, key=lambda b: b.mismatches)[:MAX_BRANCHES])


def follow(replay: Replay, branch: Branch, plan: Sequence[int], seen: Observation) -> Branch:
    """Return ``branch`` after one request whose layers decided at the times of ``plan``."""
    s = replay.step(branch.states, plan, seen.sample.cost)
    miss = int(seen.decided and s.allowed != seen.allowed)
    miss += sum(s.decisions[i] != decision for i, decision in seen.shadow.items())
    return Branch(
        s.states,
        tuple(a + b for a, b in zip(branch.charged, s.charged, strict=True)),
        tuple(a + (d != ALLOWED) for a, d in zip(branch.refused, s.decisions, strict=True)),
        branch.admitted + s.allowed,
        branch.mismatches + miss,
    )


def settle(replay: Replay, branches: set[Branch], verdict: Verdict) -> None:
    """Fill in what the paths that explain every response best expect."""
    fewest = min(b.mismatches for b in branches)
    consistent = [b for b in branches if b.mismatches == fewest]
    best = min(consistent, key=lambda b: abs(b.admitted - verdict.successes))
    verdict.admitted = verdict.successes
    verdict.expected = best.admitted
    verdict.decision_mismatches = fewest
    for i, policy in enumerate(replay.policies):
        charged = [b.charged[i] for b in consistent]
        refused = [b.refused[i] for b in consistent]
        verdict.charged[policy.id] = (min(charged), max(charged))
        verdict.refused[policy.id] = (min(refused), max(refused))


def expected_policy_header(replay: Replay) -> str | None:
    """``RateLimit-Policy`` of every response: the enforced policies' items, in the order
    their layers recorded them (shadow policies never have headers)."""
    items = [item for p in replay.policies if not p.shadow for item in p.policy_header_items()]
    return ", ".join(items) or None


def check_refusal_body(surface: Surface, replay: Replay, sample: Sample) -> bool:
    """Whether a 429 has ``Retry-After`` and the body its surface promises: problem+json
    naming one of the client's enforced policies (never a shadow one), or DRF's
    ``Throttled``."""
    if not sample.retry_after:
        return False
    try:
        body = json.loads(sample.body)
    except ValueError:
        return False
    if not isinstance(body, dict):
        return False
    if surface.refusal == "problem":
        enforced = {p.id for p in replay.policies if not p.shadow}
        items = {n for p in replay.policies if not p.shadow for n in p.item_names()}
        violated = body.get("violated-policies")
        return (
            "application/problem+json" in sample.content_type
            and body.get("type") == QUOTA_EXCEEDED_TYPE
            and body.get("status") == 429
            and body.get("policy") in enforced
            and isinstance(violated, list)
            and bool(violated)
            and set(violated) <= items
        )
    if surface.refusal == "drf":
        detail = body.get("detail")
        return (
            sample.content_type.startswith("application/json")
            and isinstance(detail, str)
            and detail.startswith(DRF_THROTTLED_PREFIX)
        )
    return False


def check_retry_after(
    replay: Replay, branches: set[Branch], sample: Sample, verdict: Verdict
) -> None:
    """Count a 429 whose Retry-After is not ceil(window end - now) for a now in [send,
    recv], the latest end among the denying windows of every layer, on any replay path
    that explains every response so far."""
    if sample.status != 429 or not sample.retry_after:
        return
    try:
        value = int(sample.retry_after)
    except ValueError:
        verdict.bad_retry_after += 1
        return
    layers = len(replay.layers)
    fewest = min(b.mismatches for b in branches)
    for branch in branches:
        if branch.mismatches != fewest:
            continue
        early = replay.step(branch.states, [sample.send_ms] * layers, sample.cost)
        late = replay.step(branch.states, [sample.recv_ms] * layers, sample.cost)
        if early.retry_after_ms is None or late.retry_after_ms is None:
            return  # this path admits it: a decision mismatch if no path refuses it
        lo = retry_after_header(late.retry_after_ms)
        hi = retry_after_header(early.retry_after_ms)
        if lo <= value <= hi:
            return
    verdict.bad_retry_after += 1


# --------------------------------------------------------------------------- counters


@dataclass(frozen=True, slots=True)
class CountRow:
    """One policy's count of one decision: the workers' sum against the replay's."""

    policy: str
    decision: str
    counted: int
    expected: tuple[int, int]
    """The fewest and the most the replay expects."""

    @property
    def ok(self) -> bool:
        lo, hi = self.expected
        return lo <= self.counted <= hi


def compare_server_counts(
    known: Mapping[str, Policy],
    clients: Sequence[Client],
    verdicts: Mapping[str, Verdict],
    stats: Mapping[int, Sequence[Mapping[str, Any]]],
) -> tuple[list[CountRow], list[str]]:
    """Compare the workers' decision counts, summed, with the replay, policy by policy:
    ``allowed`` outcomes (charged requests) and refusals (``denied`` for an enforced
    policy, ``shadow_denied`` for a shadow one; no other decision may occur). Return the
    rows and a note per policy whose counts contradict the replay."""
    totals: dict[tuple[str, str], int] = {}
    for outcomes in stats.values():
        for item in outcomes:
            key = (str(item["policy"]), str(item["decision"]))
            totals[key] = totals.get(key, 0) + int(item["count"])
    rows: list[CountRow] = []
    notes: list[str] = []
    used = [pid for pid in known if any(pid in c.spec.policy_ids for c in clients)]
    for policy_id in used:
        mine = [verdicts[c.spec.name] for c in clients if policy_id in c.spec.policy_ids]
        found = policy_counts(known[policy_id], mine, totals)
        rows.extend(found)
        wrong = [
            f"{row.decision} {row.counted} where the replay expects {span(*row.expected)}"
            for row in found
            if not row.ok
        ]
        if wrong:
            unknown = sum(v.unknown for v in mine)
            notes.append(
                f"server counters of {policy_id}: {'; '.join(wrong)}"
                + (f" ({unknown} request(s) of unknown fate)" if unknown else "")
            )
    return rows, notes


def policy_counts(
    policy: Policy, mine: Sequence[Verdict], totals: Mapping[tuple[str, str], int]
) -> list[CountRow]:
    """Return one policy's rows: ``allowed``, its refusal, and any other decision the server
    reported for it (which the replay never expects)."""
    refusal = SHADOW_DENIED if policy.shadow else DENIED
    expected = {
        ALLOWED: (
            sum(v.charged[policy.id][0] for v in mine),
            sum(v.charged[policy.id][1] for v in mine),
        ),
        refusal: (
            sum(v.refused[policy.id][0] for v in mine),
            sum(v.refused[policy.id][1] for v in mine),
        ),
    }
    others = sorted(
        decision
        for (pid, decision) in totals
        if pid == policy.id and decision not in (ALLOWED, refusal)
    )
    return [
        CountRow(
            policy.id,
            decision,
            totals.get((policy.id, decision), 0),
            expected.get(decision, (0, 0)),
        )
        for decision in (ALLOWED, refusal, *others)
    ]
