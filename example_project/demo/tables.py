"""Everything the demo prints: wrapped text within WIDTH columns, the tables with a legend
under each, and the ``--verbose`` samples of headers and bodies."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from example_project.demo.checks import CountRow, Verdict, span
from example_project.demo.policies import Policy
from example_project.demo.replay import ALLOWED, SHADOW_DENIED
from example_project.demo.scenario import CLIENT_SPECS, STATS_PATH, SURFACES, ClientSpec
from example_project.demo.traffic import Client, Sample

#: Columns of the default output: every line it prints fits in this many.
WIDTH = 100

#: Columns printed flush left (the others are counts, flush right).
TEXT_COLUMNS = {
    "client",
    "surface",
    "policy",
    "policies",
    "allowed",
    "source",
    "decision",
    "result",
}


def say(text: str = "", indent: str = "", hanging: str | None = None) -> None:
    """Print ``text`` wrapped to WIDTH columns: each of its lines starts at ``indent``,
    and what wraps continues at ``hanging`` (two columns further by default)."""
    if not text:
        print(indent.rstrip())
        return
    more = indent + "  " if hanging is None else hanging
    for line in text.splitlines():
        print(
            textwrap.fill(
                line,
                width=WIDTH,
                initial_indent=indent,
                subsequent_indent=more,
                break_on_hyphens=False,
            )
        )


def print_table(rows: Sequence[Sequence[str]], headers: Sequence[str], indent: str = "") -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    numeric = {i for i, h in enumerate(headers) if h not in TEXT_COLUMNS}

    def fmt(cells: Sequence[str]) -> str:
        return (
            indent
            + "  ".join(
                c.rjust(w) if i in numeric else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()
        )

    print(fmt(headers))
    print(indent + "  ".join("-" * w for w in widths))
    for row in rows:
        print(fmt(row))


def print_legend(columns: Sequence[tuple[str, str]], indent: str = "") -> None:
    """What each column of the table above means, one wrapped entry per column."""
    print()
    print(f"{indent}Columns:")
    for name, meaning in columns:
        say(f"{name}: {meaning}", indent + "  ", indent + "    ")


def print_setup(
    backend: str, workers: int, key_prefix: str, database: str, known: Mapping[str, Policy]
) -> None:
    """Print the opening lines: how the server runs, its policies, and the surfaces exercised."""
    print("django-quota demo")
    say(f"  backend:    {backend}", hanging=" " * 14)
    print(f"  workers:    {workers} gunicorn sync worker(s)")
    print(f"  key prefix: {key_prefix}")
    say(f"  database:   {database}", hanging=" " * 14)
    for policy in known.values():
        say(f"  policy      {policy.describe()}", hanging=" " * 16)
    print("  surfaces:")
    for surface in SURFACES:
        paths = sorted({a.label for s in CLIENT_SPECS if s.surface is surface for a in s.actions})
        say(f"    {surface.name + ':':<15}{', '.join(paths)}: {surface.about}", hanging=" " * 21)


def print_latency(clients: Sequence[Client]) -> None:
    """Response times (send to last byte): a slow response may straddle a boundary."""
    times = sorted(s.recv_ms - s.send_ms for c in clients for s in c.samples)
    if not times:
        return

    def pct(q: float) -> int:
        return times[min(len(times) - 1, math.ceil(q * len(times)) - 1)]

    say(
        f"{len(times)} requests; response times: median {pct(0.5)} ms, 99th percentile "
        f"{pct(0.99)} ms, max {times[-1]} ms"
    )


# --------------------------------------------------------------------------- clients

CLIENT_COLUMNS = (
    (
        "client",
        "one load generator; each sends from its own loopback address, so each is its own "
        "ip subject (its address and policies are in the next table)",
    ),
    ("surface", "how django-quota meets its requests (the surfaces listed at the start)"),
    ("sent", "requests it sent"),
    ("2xx", "responses with the endpoint's success status (200, or 201 for a create)"),
    (
        "429",
        "refused requests; a shadow row has none, since a shadow policy decides and counts "
        "but never refuses",
    ),
    ("Retry-After", "the Retry-After header of its first 429 (- when it got none)"),
    (
        "admitted",
        "the requests the server admitted, as the client saw them; a request is admitted "
        "only when every layer (middleware, throttle, decorator) admits it, and then it "
        "answers the success status, so this is the 2xx count (any other status is a "
        "problem, listed at the end)",
    ),
    (
        "expected",
        "the requests the replay of the fixed-window arithmetic admits, given the same "
        "requests at the same times",
    ),
    (
        "ambiguous",
        "requests whose [send, receive] interval straddled a window boundary despite the "
        "guard; the replay follows every window assignment that yields the status observed",
    ),
    (
        "result",
        "OK when admitted equals expected and every status, Retry-After, RateLimit-Policy "
        "header and 429 body is right; MISMATCH otherwise, with the reason at the end",
    ),
)


def print_clients(clients: Sequence[Client], verdicts: Mapping[str, Verdict]) -> None:
    """Print the table of clients: what each sent and got, and what the replay expects."""
    rows: list[list[str]] = []
    for client in clients:
        verdict = verdicts[client.spec.name]
        rows.append(
            [
                client.spec.name,
                client.spec.surface.name,
                str(verdict.sent),
                str(verdict.successes),
                str(verdict.denied),
                verdict.first_retry_after or "-",
                str(verdict.admitted),
                str(verdict.expected),
                str(verdict.ambiguous),
                "OK" if verdict.ok else "MISMATCH",
            ]
        )
    print_table(rows, [name for name, _ in CLIENT_COLUMNS])
    print_legend(CLIENT_COLUMNS)


def layered(spec: ClientSpec, cells: Mapping[str, str]) -> str:
    """One cell per policy of ``spec``: ``+`` within a layer, ``then`` between layers."""
    return " then ".join("+".join(cells[pid] for pid in layer) for layer in spec.layers)


def print_policies(clients: Sequence[Client], verdicts: Mapping[str, Verdict]) -> None:
    """Each client's source address and policies, and what the replay says each policy
    allowed (the counts the server's counters add up)."""
    rows: list[list[str]] = []
    for client in clients:
        charged = verdicts[client.spec.name].charged
        rows.append(
            [
                client.spec.name,
                client.source_ip,
                layered(client.spec, {pid: pid for pid in client.spec.policy_ids}),
                layered(client.spec, {pid: span(*charged[pid]) for pid in client.spec.policy_ids}),
            ]
        )
    print()
    print_table(rows, ["client", "source", "policies", "allowed"])
    print_legend(
        (
            ("client", "as in the table above"),
            ("source", "the loopback address it sends from: the server's REMOTE_ADDR"),
            (
                "policies",
                "the policies that decide its requests, layer by layer: '+' joins the "
                "policies one layer decides together (charged only if each enforced one "
                "admits), 'then' separates the layers, in the order they decide",
            ),
            (
                "allowed",
                "per policy, in the same order, the requests the replay says it allowed, "
                "that is charged (a range when requests were ambiguous); the server "
                "counters below add these up over the clients. A shadow policy's count is "
                "the requests it admitted, not the 2xx." + _own_layers(clients),
            ),
        )
    )


def _own_layers(clients: Sequence[Client]) -> str:
    """Explain why a client decided by several layers is counted beyond its 2xx, if any is."""
    several = [c.spec for c in clients if len(c.spec.layers) > 1]
    if not several:
        return ""
    spec = several[0]
    first, later = "+".join(spec.layers[0]), "+".join(spec.layers[-1])
    return (
        f" Each layer charges on its own, since DRF asks every throttle even after one "
        f"refused: for {spec.name}, {first} counts the requests {later} refused and "
        f"{later} those {first} refused, so either count can exceed its 2xx (the "
        f"requests both admitted)."
    )


def print_shadow(
    known: Mapping[str, Policy], clients: Sequence[Client], verdicts: Mapping[str, Verdict]
) -> None:
    """Print what each shadow policy would have refused: as the view reported, as replayed."""
    for policy in known.values():
        if not policy.shadow:
            continue
        mine = [c for c in clients if policy.id in c.spec.policy_ids]
        print()
        say(
            f"Shadow policy {policy.id} ({', '.join(w.describe() for w in policy.windows)} per "
            f"{'+'.join(policy.selector)}, routes {list(policy.routes)}): never refuses"
        )
        for client in mine:
            v = verdicts[client.spec.name]
            lo, hi = v.refused[policy.id]
            say(
                f"{client.spec.name}: {v.sent} sent, {v.successes} answered 2xx, "
                f"{v.denied} refused; the policy would have refused {v.reported[policy.id]} "
                f"(shadow_denied, as the view reported), the replay expects {span(lo, hi)}",
                "  ",
                "    ",
            )


# --------------------------------------------------------------------------- counters

SERVER_COLUMNS = (
    ("policy", "a policy that some client's requests met"),
    (
        "decision",
        "allowed (the requests it charged), or its refusal: denied for an enforced policy, "
        "shadow_denied for a shadow one; any other decision the server reports gets a row "
        "of its own, which fails",
    ),
    ("server", "that decision's count, summed over every worker's /api/quota-stats/"),
    (
        "replay",
        "the count the replay expects, summed over the clients (a range when requests "
        "were ambiguous)",
    ),
    ("result", "OK when the server's count lies within the replay's; MISMATCH otherwise"),
)


def print_counts_not_checked(stats: Mapping[int, Any], pids: set[int]) -> None:
    """Say that the server's counters went unchecked, and which workers did not answer."""
    print()
    missing = sorted(pids - set(stats))
    say(
        f"Server counters: NOT CHECKED: workers {missing} did not answer {STATS_PATH} "
        f"(answered: {sorted(set(stats))})"
    )


def print_server_counts(stats: Mapping[int, Any], rows: Sequence[CountRow]) -> None:
    """Print the table of the workers' summed counters against the replay's."""
    print()
    answered = sorted(set(stats))
    say(
        f"Server counters: {STATS_PATH} of every worker ({len(answered)} pid(s) "
        f"{answered}), summed, against the replay"
    )
    cells = [
        [
            row.policy,
            row.decision,
            str(row.counted),
            span(*row.expected),
            "OK" if row.ok else "MISMATCH",
        ]
        for row in rows
    ]
    print_table(cells, [name for name, _ in SERVER_COLUMNS], indent="  ")
    print_legend(SERVER_COLUMNS, indent="  ")


# --------------------------------------------------------------------------- samples


def _json_or_text(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except ValueError:
        return text


def print_samples(clients: Sequence[Client]) -> None:
    """One 2xx and one 429 per surface and policy group: headers and body (``--verbose``;
    the headers and bodies are printed whole, however long)."""
    groups: dict[tuple[str, tuple[tuple[str, ...], ...]], list[Client]] = {}
    for client in clients:
        groups.setdefault((client.spec.surface.name, client.spec.layers), []).append(client)
    print()
    print("Headers and bodies, per surface (the first of each kind):")
    for (surface, layers), mine in groups.items():
        samples = [s for c in mine for s in c.samples]
        actions = sorted({s.action.label for s in samples})
        names = ", ".join(c.spec.name for c in mine)
        policies = " then ".join("+".join(layer) for layer in layers)
        print(f"  {surface}: {policies} on {', '.join(actions)} ({names})")
        if mine[0].spec.surface.refusal is None:
            _print_shadow_samples(samples)
        else:
            _print_enforced_samples(samples)


def _print_shadow_samples(samples: Sequence[Sample]) -> None:
    """Print a request the shadow policy admitted and one it would have refused."""
    for decision in (ALLOWED, SHADOW_DENIED):
        found = next(
            (s for s in samples if s.decisions and decision in dict(s.decisions).values()),
            None,
        )
        if found is None:
            continue
        verb = "admitted" if decision == ALLOWED else "would refuse"
        print(
            f"    a {found.status} it {verb}:"
            f" RateLimit-Policy: {found.ratelimit_policy or '(none)'}; RateLimit: "
            f"{found.ratelimit or '(none)'}; Retry-After: {found.retry_after or '(none)'}"
        )
        quota = [{"policy": p, "decision": d} for p, d in (found.decisions or ())]
        print(f'      body "quota": {json.dumps(quota)}')


def _print_enforced_samples(samples: Sequence[Sample]) -> None:
    """Print the headers of an admitted request, and the headers and body of a refused one."""
    allowed = next(
        (s for s in samples if s.status == s.action.success and s.ratelimit_policy), None
    )
    refused = next((s for s in samples if s.status == 429), None)
    if allowed is not None:
        print(f"    a {allowed.status}: RateLimit-Policy: {allowed.ratelimit_policy}")
        print(f"           RateLimit: {allowed.ratelimit}")
    if refused is not None:
        print(f"    a 429: Retry-After: {refused.retry_after}")
        print(f"           RateLimit: {refused.ratelimit}")
        print(f"           Content-Type: {refused.content_type}")
        print(f"           body: {_json_or_text(refused.body)}")


def print_ending(problems: Sequence[str], notes: Sequence[str], ok: bool) -> None:
    """Print the closing lines: what gunicorn logged amiss, every problem found, the verdict."""
    if problems:
        print()
        print(f"gunicorn logged {len(problems)} problem line(s); the first ones:")
        for line in problems[:10]:
            say(line, "  ", "    ")
    print()
    if notes:
        print("Problems:")
        for note in notes:
            say(note, "  ", "    ")
    if ok:
        print("All decisions match the fixed-window arithmetic: OK")
    else:
        print("FAILED")
