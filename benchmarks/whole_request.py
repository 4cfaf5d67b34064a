"""The whole-request rows: requests through Django's ``WSGIHandler``, in process.

No socket reaches the app: each decision builds a WSGI environ dict (``GET``, the row's
path, the subject as ``REMOTE_ADDR``), calls the handler with a ``start_response`` that
records the status, consumes the response iterable and closes it (which sends
``request_finished``, as a WSGI server does). 200 is an admitted request, 429 a refused
one; any other status stops the run.

A handler reads ``MIDDLEWARE`` once, when it is built (``BaseHandler.load_middleware``),
so each row builds its own under ``override_settings(MIDDLEWARE=...)``: the bench's
settings have none, and only the middleware row's handler has ``QuotaMiddleware``.
"""

from __future__ import annotations

import importlib.util
import io
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from benchmarks import django_settings as bench_settings
from benchmarks.contenders import BULK, DQ, Contender, Decide, DecisionFailed, Maker

if TYPE_CHECKING:
    from benchmarks.report import Row

QUOTA_MIDDLEWARE = "django_quota.middleware.QuotaMiddleware"
IMPLEMENTATION = "request:"
DRF_BASE = "request/drf"
DRF_THROTTLED = "request/drf+drf-anon"
DRF_QUOTA = "request/drf+quota-anon"
PLAIN_BASE = "request/plain"
PLAIN_MIDDLEWARE = "request/plain+middleware"
PLAIN_RATELIMIT = "request/plain+django-ratelimit"
PLAIN_QUOTA_RATELIMIT = "request/plain+quota-ratelimit"
OK = 200
TOO_MANY_REQUESTS = 429

StartResponse = Callable[..., Callable[[bytes], object]]


def environ(url_path: str, subject: str) -> dict[str, Any]:
    """A minimal WSGI environ (PEP 3333) for ``GET url_path`` from ``subject``."""
    return {
        "REQUEST_METHOD": "GET",
        "SCRIPT_NAME": "",
        "PATH_INFO": url_path,
        "QUERY_STRING": "",
        "SERVER_NAME": bench_settings.HOST,
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": bench_settings.HOST,
        "REMOTE_ADDR": subject,
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(b""),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }


def handler(middleware: Sequence[str]) -> Callable[[dict[str, Any], StartResponse], Any]:
    """A ``WSGIHandler`` whose middleware chain is ``middleware``."""
    from django.core.handlers.wsgi import WSGIHandler
    from django.test import override_settings

    with override_settings(MIDDLEWARE=list(middleware)):
        return WSGIHandler()


def request_maker(url_path: str, middleware: Sequence[str] = ()) -> Maker:
    """A maker whose decide function is one whole request to ``url_path``."""

    def make(kind: str) -> Decide:
        if kind != BULK:
            raise ValueError("whole-request rows measure admitted requests only")
        app = handler(middleware)

        def decide(subject: str) -> bool:
            statuses: list[str] = []

            def start_response(
                status: str, headers: list[tuple[str, str]], exc_info: Any = None
            ) -> Callable[[bytes], object]:
                statuses.append(status)
                return _no_write

            response: Iterable[bytes] = app(environ(url_path, subject), start_response)
            try:
                for _ in response:
                    pass
            finally:
                close = getattr(response, "close", None)
                if close is not None:
                    close()
            code = int(statuses[-1].split(" ", 1)[0]) if statuses else 0
            if code == OK:
                return True
            if code == TOO_MANY_REQUESTS:
                return False
            raise DecisionFailed(f"GET {url_path}: {statuses[-1] if statuses else 'no status'}")

        return decide

    return make


def added_us(row: Row, by_key: Mapping[str, Row]) -> float | None:
    """Median µs a whole-request row adds over its base row; None without a base."""
    base = by_key.get(row.base) if row.base else None
    return None if base is None else row.median_us - base.median_us


def _no_write(data: bytes) -> object:
    raise RuntimeError("the bench's views return their body; nothing writes")


def _row(
    implementation: str,
    algorithm: str,
    key: str,
    reference: str,
    make: Maker,
    base: str | None = None,
) -> Contender:
    return Contender(
        f"{IMPLEMENTATION} {implementation}",
        algorithm,
        key,
        reference,
        make,
        exact=False,
        base=base,
    )


def contenders(notes: list[str]) -> list[Contender]:
    """The whole-request rows: DRF's base and throttled views, the plain view's."""
    rows: list[Contender] = []
    if importlib.util.find_spec("rest_framework") is None:
        notes.append("djangorestframework is not installed: whole-request DRF rows skipped")
    else:
        rows += [
            _row(
                "DRF APIView",
                "no throttle (base)",
                DRF_BASE,
                "",
                request_maker(bench_settings.DRF_PATH),
            ),
            _row(
                "DRF APIView + DRF AnonRateThrottle",
                "sliding log (SimpleRateThrottle)",
                DRF_THROTTLED,
                DRF_QUOTA,
                request_maker(bench_settings.DRF_THROTTLED_PATH),
                base=DRF_BASE,
            ),
            _row(
                f"DRF APIView + {DQ} AnonRateThrottle",
                "sliding_log (drop-in default)",
                DRF_QUOTA,
                DRF_QUOTA,
                request_maker(bench_settings.DRF_QUOTA_PATH),
                base=DRF_BASE,
            ),
        ]
    rows += [
        _row(
            "plain view",
            "no middleware (base)",
            PLAIN_BASE,
            "",
            request_maker(bench_settings.PLAIN_PATH),
        ),
        _row(
            f"plain view + {DQ} QuotaMiddleware",
            f"{bench_settings.MIDDLEWARE_ALGORITHM}, 1 policy",
            PLAIN_MIDDLEWARE,
            PLAIN_MIDDLEWARE,
            request_maker(bench_settings.PLAIN_PATH, [QUOTA_MIDDLEWARE]),
            base=PLAIN_BASE,
        ),
    ]
    rate = bench_settings.RATELIMIT_RATE
    if importlib.util.find_spec("django_ratelimit") is None:
        notes.append("django-ratelimit is not installed: its whole-request row skipped")
    else:
        rows.append(
            _row(
                f'plain view + django-ratelimit @ratelimit(key="ip", rate="{rate}")',
                "fixed window (RedisCache add + incr)",
                PLAIN_RATELIMIT,
                PLAIN_QUOTA_RATELIMIT,
                request_maker(bench_settings.RATELIMIT_PATH),
                base=PLAIN_BASE,
            )
        )
    rows.append(
        _row(
            f'plain view + {DQ} @ratelimit(key="ip", rate="{rate}")',
            "fixed window (one script)",
            PLAIN_QUOTA_RATELIMIT,
            PLAIN_QUOTA_RATELIMIT,
            request_maker(bench_settings.QUOTA_RATELIMIT_PATH),
            base=PLAIN_BASE,
        )
    )
    return rows
