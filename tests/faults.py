"""Real faults for the failure tests (docs/failures.md): a dedicated ``redis-server`` per test
that can be stopped, killed with SIGKILL and restarted on the same port; a threaded
loopback TCP proxy in front of it whose mode can be switched while clients use it; and a
reader of what Redis really charged."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from django_quota.core.protocol import decode_counter
from tests.conftest import require_redis_server

FORWARD = "forward"
LATENCY = "latency"
REFUSE = "refuse"
BLACKHOLE = "blackhole"
DROP_REPLY = "drop_reply"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisProcess:
    """One ``redis-server`` on a free loopback port, with nothing saved unless asked.

    ``start`` waits for ``PING``; ``stop`` shuts it down (``save=True``: ``SHUTDOWN SAVE``
    into a private directory, so the next start reloads the data), ``kill`` sends SIGKILL,
    ``restart`` stops and starts on the same port.
    """

    def __init__(self, *extra_args: str) -> None:
        self.port = free_port()
        self.extra_args = extra_args
        self.directory = tempfile.mkdtemp(prefix="quota-faults-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **options: Any) -> redis.Redis:
        """A plain client for the test itself (its own timeouts; no retries, which would
        back off for seconds after a ``SHUTDOWN``)."""
        options.setdefault("socket_timeout", 5.0)
        options.setdefault("socket_connect_timeout", 1.0)
        options.setdefault("retry", Retry(NoBackoff(), 0))
        return redis.Redis(host="127.0.0.1", port=self.port, protocol=2, **options)

    def start(self, *, ready: bool = True) -> None:
        """Start the server; wait for ``PING`` (``ready=False``: only until it listens,
        which may still be while it loads its dataset and answers ``LOADING``)."""
        assert self.process is None, "already running"
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--bind",
                "127.0.0.1",
                "--dir",
                self.directory,
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10.0
        if not ready:
            while True:
                try:
                    socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                    return
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("redis-server did not listen within 10 s") from None
                    time.sleep(0.005)
        with contextlib.closing(self.client(socket_timeout=0.5)) as client:
            while True:
                try:
                    if client.ping():
                        return
                except redis.exceptions.BusyLoadingError:
                    pass
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                    if self.process.poll() is not None:
                        code = self.process.returncode
                        raise RuntimeError(f"redis-server exited with {code}") from exc
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not answer PING within 10 s")
                time.sleep(0.01)

    def stop(self, *, save: bool = False) -> None:
        """Shut the server down and wait for the process to end."""
        process, self.process = self.process, None
        if process is None:
            return
        if save:
            with (
                contextlib.suppress(redis.exceptions.ConnectionError),
                contextlib.closing(self.client()) as client,
            ):
                client.shutdown(save=True)
        else:
            process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save, sockets reset by the kernel."""
        process, self.process = self.process, None
        if process is not None:
            process.kill()  # SIGKILL
            process.wait(timeout=10)

    def restart(self, *, save: bool = False) -> None:
        self.stop(save=save)
        self.start()

    def close(self) -> None:
        if self.process is not None:
            self.kill()
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                os.unlink(os.path.join(self.directory, name))
            os.rmdir(self.directory)


@contextlib.contextmanager
def redis_process(*extra_args: str) -> Iterator[RedisProcess]:
    """A started :class:`RedisProcess`, killed at the end whatever happens.

    Skips locally and fails in CI (``CI=true``) when no ``redis-server`` binary exists.
    """
    require_redis_server()
    server = RedisProcess(*extra_args)
    try:
        server.start()
        yield server
    finally:
        server.close()


@dataclass(eq=False)
class _Link:
    """One proxied client connection (``upstream`` None when black-holed)."""

    client: socket.socket
    upstream: socket.socket | None
    drop_next_reply: bool = False
    closed: bool = False


def _shut(sock: socket.socket | None) -> None:
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class Proxy:
    """A threaded TCP proxy on 127.0.0.1 in front of ``upstream_port``.

    Modes, switchable at any time, read for every chunk:

    - ``forward()``: pass bytes both ways.
    - ``latency(seconds)``: delay every server -> client chunk (the request reaches Redis
      at once; the reply is late).
    - ``refuse()``: close the listening socket (connects are refused) and reset every open
      connection, as a dead host would; ``forward()`` listens again on the same port.
    - ``blackhole()``: accept and read, never answer, never reach Redis (open connections
      too).
    - ``drop_reply(count)``: forward everything, but after a client -> server chunk holding
      ``EVALSHA``, drop Redis's reply and close that client connection; after ``count``
      drops, back to ``forward``. The script ran; the client never learns.

    Counters: ``accepted`` connections, ``evalsha_seen`` (EVALSHA commands forwarded),
    ``eval_seen`` (plain EVAL commands: the library must send none), ``replies_dropped``.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._lock = threading.Lock()
        self._mode = FORWARD
        self._latency = 0.0
        self._drops_left = 0
        self._links: set[_Link] = set()
        self._listener: socket.socket | None = None
        self._listening = threading.Event()
        self._stop_accepting = threading.Event()
        self._accept_thread: threading.Thread | None = None
        self.accepted = 0
        self.evalsha_seen = 0
        self.eval_seen = 0
        self.replies_dropped = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def mode(self) -> str:
        return self._mode

    # -- modes ---------------------------------------------------------------------------
    def forward(self) -> None:
        with self._lock:
            self._mode = FORWARD
        self._listen()

    def latency(self, seconds: float) -> None:
        with self._lock:
            self._mode, self._latency = LATENCY, seconds
        self._listen()

    def blackhole(self) -> None:
        with self._lock:
            self._mode = BLACKHOLE
        self._listen()

    def drop_reply(self, count: int = 1) -> None:
        with self._lock:
            self._mode, self._drops_left = DROP_REPLY, count
        self._listen()

    def refuse(self) -> None:
        with self._lock:
            self._mode = REFUSE
        self._unlisten()
        self.reset_connections()

    def reset_connections(self) -> None:
        """Close every proxied connection (both sides)."""
        with self._lock:
            links = list(self._links)
        for link in links:
            self._close(link)

    def close(self) -> None:
        self._unlisten()
        self.reset_connections()

    # -- listening -----------------------------------------------------------------------
    def _listen(self) -> None:
        if self._listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        listener.settimeout(0.02)
        self._listener = listener
        self._stop_accepting = threading.Event()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, args=(listener, self._stop_accepting), daemon=True
        )
        self._accept_thread.start()

    def _unlisten(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        self._stop_accepting.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        listener.close()

    def _accept_loop(self, listener: socket.socket, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.accepted += 1
                mode = self._mode
            upstream = None
            if mode != BLACKHOLE:
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.upstream_port), 1.0)
                    upstream.settimeout(None)
                    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    _shut(client)  # Redis is down: the client sees its connection closed
                    continue
            link = _Link(client, upstream)
            with self._lock:
                self._links.add(link)
            threading.Thread(target=self._client_to_server, args=(link,), daemon=True).start()
            if upstream is not None:
                threading.Thread(target=self._server_to_client, args=(link,), daemon=True).start()

    # -- pumps ---------------------------------------------------------------------------
    def _close(self, link: _Link) -> None:
        with self._lock:
            if link.closed:
                return
            link.closed = True
            self._links.discard(link)
        _shut(link.client)
        _shut(link.upstream)

    def _client_to_server(self, link: _Link) -> None:
        try:
            while True:
                data = link.client.recv(65536)
                if not data:
                    break
                with self._lock:
                    mode = self._mode
                    if link.upstream is None or mode == BLACKHOLE:
                        continue  # read, never answered
                    evalsha = data.count(b"EVALSHA")
                    self.evalsha_seen += evalsha
                    self.eval_seen += data.count(b"$4\r\nEVAL\r\n")
                    if evalsha and mode == DROP_REPLY and self._drops_left > 0:
                        self._drops_left -= 1
                        link.drop_next_reply = True
                        if self._drops_left == 0:
                            self._mode = FORWARD
                link.upstream.sendall(data)
        except OSError:
            pass
        self._close(link)

    def _server_to_client(self, link: _Link) -> None:
        assert link.upstream is not None
        try:
            while True:
                data = link.upstream.recv(65536)
                if not data:
                    break
                with self._lock:
                    mode, delay, drop = self._mode, self._latency, link.drop_next_reply
                    if drop:
                        self.replies_dropped += 1
                if drop:
                    break
                if mode == LATENCY:
                    time.sleep(delay)
                link.client.sendall(data)
        except OSError:
            pass
        self._close(link)


@contextlib.contextmanager
def proxy_to(server: RedisProcess) -> Iterator[Proxy]:
    """A forwarding :class:`Proxy` in front of ``server``, closed at the end."""
    proxy = Proxy(server.port)
    proxy.forward()
    try:
        yield proxy
    finally:
        proxy.close()


# -- what Redis really did ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ledger:
    """Per counter key: the count Redis holds (``c1``), the fingerprints of the charged
    evaluations its evaluation-id ledger holds (field ``e``, 5 bytes each), and
    whether that ledger dropped a young one (field ``d``), for single-window policies.

    While nothing was dropped, the ledger lists every evaluation that charged the
    counter: ``counts == charged`` then says no charge happened without an evaluation
    that Redis ran and recorded, and none was recorded twice."""

    counts: dict[str, int]
    starts: dict[str, int]
    fingerprints: dict[str, list[bytes]]
    dropped: set[str]

    @property
    def charged(self) -> dict[str, int]:
        """Per counter: the charging evaluations its ledger holds (distinct)."""
        return {key: len(set(self.fingerprints.get(key, ()))) for key in self.counts}

    @property
    def records(self) -> int:
        """Fingerprints held over every counter."""
        return sum(len(prints) for prints in self.fingerprints.values())


def read_ledger(client: redis.Redis, period_ms: int, algorithm: str = "fixed_window") -> Ledger:
    """Read every counter back (pipelined, ``decode_counter``). Needs ``DEDUP_TTL`` longer
    than the test, and cost-1 evaluations of one one-window policy per call (windows of
    ``period_ms``)."""
    keys = [raw.decode() for raw in client.scan_iter(count=1000)]
    counts: dict[str, int] = {}
    starts: dict[str, int] = {}
    fingerprints: dict[str, list[bytes]] = {}
    dropped: set[str] = set()
    for offset in range(0, len(keys), 1000):
        batch = keys[offset : offset + 1000]
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.get(key)
        for key, value in zip(batch, pipe.execute(), strict=True):
            state, records = decode_counter(value, algorithm, 1)
            if state is None or "t" not in state:
                continue
            counts[key] = state["c1"]
            starts[key] = state["t"] - state["t"] % period_ms
            fingerprints[key] = [records[i : i + 5] for i in range(0, len(records), 9)]
            if "d" in state:
                dropped.add(key)
    return Ledger(counts, starts, fingerprints, dropped)


def raw_command(port: int, *parts: bytes) -> socket.socket:
    """Send one RESP command on a fresh raw socket and return the socket unread (for
    commands that block, such as a script that never ends)."""
    sock = socket.create_connection(("127.0.0.1", port), 2.0)
    payload = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    sock.sendall(payload)
    return sock


# -- reporting -----------------------------------------------------------------------------
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


class Report:
    """Measurements a test module shows in pytest's terminal summary (no ``-s`` needed)
    and saves as ``test-artifacts/<name>.json`` (git-ignored), for the docs and the lead.

    ``observe`` keeps, per case, the worst latency seen and what the case decided.
    """

    def __init__(self, name: str, title: str) -> None:
        self.name = name
        self.title = title
        self.rows: dict[str, dict[str, Any]] = {}
        self.counts: dict[str, float] = {}

    def observe(self, case: str, seconds: float, **observed: Any) -> None:
        row = self.rows.setdefault(case, {"calls": 0, "worst_seconds": 0.0})
        row["calls"] += 1
        row["worst_seconds"] = round(max(row["worst_seconds"], seconds), 4)
        row.update(observed)

    def install(self, config: Any) -> None:
        """Register as a plugin once, so pytest calls :meth:`pytest_terminal_summary`."""
        if not config.pluginmanager.is_registered(self):
            config.pluginmanager.register(self, f"django-quota-report-{self.name}")

    def save(self) -> None:
        if not self.rows and not self.counts:
            return
        ARTIFACTS.mkdir(exist_ok=True)
        body = {"cases": self.rows, "counts": self.counts}
        (ARTIFACTS / f"{self.name}.json").write_text(json.dumps(body, indent=2, sort_keys=True))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.rows and not self.counts:
            return
        terminalreporter.section(self.title)
        width = max((len(case) for case in self.rows), default=0)
        for case, row in sorted(self.rows.items()):
            details = " ".join(
                f"{k}={v}" for k, v in sorted(row.items()) if k not in ("calls", "worst_seconds")
            )
            terminalreporter.write_line(
                f"{case:{width}}  worst {row['worst_seconds'] * 1000:7.1f} ms"
                f"  ({row['calls']} calls)  {details}"
            )
        for name, value in sorted(self.counts.items()):
            terminalreporter.write_line(f"{name:32} {value}")
        terminalreporter.write_line(f"saved: {ARTIFACTS / (self.name + '.json')}")
