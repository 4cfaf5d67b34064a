"""Run the example project under gunicorn, load every HTTP surface over TCP and check
every quota decision.

``python -m example_project.demo`` (or ``scripts/demo``):

1. migrates the SQLite database, seeds a few items and the API users (DRF tokens);
2. starts ``gunicorn example_project.wsgi`` on a free port of 127.0.0.1: one worker with the
   memory backend (``REDIS_URL`` unset; its counters live in one process), or ``--workers``
   (default 3) with Redis, under a fresh ``QUOTA["KEY_PREFIX"]`` so that no two runs share
   a counter and nothing else in Redis is touched;
3. runs concurrent HTTP clients for ``--seconds``, each bound to its own loopback source
   address (127.0.0.2, 127.0.0.3, ...), so that each is a distinct ``ip`` subject, against
   every surface django-quota has: ``QuotaMiddleware`` (enforced and shadow policies), the
   DRF drop-in ``AnonRateThrottle``/``UserRateThrottle``, ``QuotaThrottle`` and ``@quota``
   (with a cost that depends on the request);
4. replays what each client sent through the fixed-window arithmetic (docs/arithmetic.md)
   and compares, request by request, what the server decided with what it had to decide;
5. asks every worker for its decision counts (``GET /api/quota-stats/``) and compares their
   sum, policy by policy, with the replay.

What it prints fits in 100 columns: a table per client, one of each client's source address
and policies, one of the server's counters, each with a legend of its columns under it.
``--verbose`` adds one sample per surface of the rate-limit headers and of a 429 body (the
server's own lines, as long as they are).

Why the expected counts are exact: fixed windows are aligned to the Unix epoch and the
server and the clients read the same clock. A client never sends a request while a
boundary of one of its policies' windows is nearer than ``--guard-ms``, so a request's
[send, receive] interval normally lies inside one window of every period, and wherever in
that interval the server read its clock, it counted the request in the windows the client
computes from the send time. If an interval straddles a boundary anyway (a slow response),
the request is *ambiguous*: the replay then follows each possible window assignment that
yields the status actually observed (one of them is what the server did, if it is right),
and the client passes when one such path explains every response. A request the server
must have decided differently in every path is a mismatch.

What a request costs, and what it is charged to:

- a layer is one backend call deciding a group of policies together: the middleware's
  matching policies, one DRF throttle, one ``@quota``. A group's windows are charged only
  if each of its enforced policies admits the request (``count + cost <= limit`` in every
  window); a shadow policy is then charged if it admits too, and it never refuses;
- DRF asks every throttle of a view even after one refused (its loop), so each throttle
  charges on its own: an anonymous caller of ``/api/me/`` is counted by ``drf:user`` on
  requests that ``drf:anon`` refuses;
- ``@quota`` on ``/api/export/`` charges ``?size=`` (1 to 3) to both windows.

Exit status: 0 when every client matches; 1 on a mismatch, a 5xx, any status other than
the endpoint's success status or 429, a malformed 429, wrong rate-limit headers, a 429 on
the shadow policy's route, server counts that contradict the replay, or a transport
error; 2 when the demo could not be set up.

Where each job lives: ``policies`` reads the policies the server enforces, ``scenario``
declares the clients and what they send, ``servers`` sets up the project and runs gunicorn,
``traffic`` sends the requests, ``replay`` is the fixed-window arithmetic, ``checks``
judges the responses and the server's counters against it, ``tables`` prints, and ``cli``
runs the steps in order.
"""

from __future__ import annotations


class SetupError(Exception):
    """The demo could not be set up (reported with exit status 2)."""
