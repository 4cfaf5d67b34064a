"""A throwaway ``redis-server`` on a free loopback port, stopped when the block ends.

Never the machine's Redis: the port is chosen by the kernel (never 6379), persistence is
off (``--save '' --appendonly no``) and the working directory is a temporary one removed
at the end. On Linux the server also gets ``PR_SET_PDEATHSIG``, so it dies with the
benchmark even if the benchmark is killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

LOOPBACK = "127.0.0.1"
MACHINE_REDIS_PORT = 6379
START_ATTEMPTS = 3
START_TIMEOUT = 5.0
STOP_TIMEOUT = 5.0


def free_port() -> int:
    """A loopback port the kernel says is free right now (never 6379)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            port = int(sock.getsockname()[1])
        if port != MACHINE_REDIS_PORT:
            return port


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class RedisServer:
    """``with RedisServer() as server: server.url``: a private redis-server."""

    def __init__(
        self,
        binary: str = "redis-server",
        *,
        prefix: tuple[str, ...] = (),
        start_timeout: float = START_TIMEOUT,
    ) -> None:
        self.binary = binary
        #: A command the server runs under (``valgrind --tool=callgrind ...``).
        self.prefix = prefix
        self.start_timeout = start_timeout
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.directory: Path | None = None
        self.version = ""

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain client for the benchmark's own bookkeeping (INFO, MEMORY USAGE, ...)."""
        return redis.Redis(host=LOOPBACK, port=self.port, db=0, socket_timeout=10.0)

    def __enter__(self) -> RedisServer:
        if shutil.which(self.binary) is None:
            raise RuntimeError(
                f"{self.binary} not found on PATH (Debian: apt-get install redis-server)"
            )
        self.directory = Path(tempfile.mkdtemp(prefix="django-quota-bench-"))
        try:
            for _ in range(START_ATTEMPTS):
                if self._start():
                    return self
            raise RuntimeError(f"redis-server did not start; see {self.directory}/redis.log")
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _start(self) -> bool:
        assert self.directory is not None
        self.port = free_port()
        log = self.directory / "redis.log"
        self.process = subprocess.Popen(
            [
                *self.prefix,
                self.binary,
                "--bind",
                LOOPBACK,
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                "--logfile",
                str(log),
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the benchmark, which stops the server
            preexec_fn=_die_with_parent,  # started before any benchmark thread exists
        )
        deadline = time.monotonic() + self.start_timeout
        client = self.client()
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    self.process = None  # lost the port race: try another port
                    return False
                try:
                    client.ping()
                except redis.exceptions.ConnectionError:
                    time.sleep(0.02)
                    continue
                self.version = str(client.info("server")["redis_version"])
                return True
        finally:
            client.close()
        self._terminate()
        return False

    def _terminate(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT)

    def stop(self) -> None:
        """Stop the server (idempotent) and remove its directory."""
        try:
            self._terminate()
        finally:
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
                self.directory = None
