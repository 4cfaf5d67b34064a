"""Setting the example project up (Redis, loopback addresses, database, API users) and the
gunicorn it runs under, started and always stopped by the demo."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import requests

from example_project.demo import SetupError
from example_project.demo.scenario import STATS_PATH, USERS
from example_project.demo.tables import say

REPO_DIR = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
GUNICORN_LOG = REPO_DIR / "var" / "demo-gunicorn.log"

STARTUP_TIMEOUT = 45.0
STOP_TIMEOUT = 15.0
COMMAND_TIMEOUT = 120.0
STATS_TIMEOUT = 15.0

T = TypeVar("T")


def redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_loopback_sources(addresses: Sequence[str]) -> None:
    for address in addresses:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, 0))
            except OSError as exc:
                raise SetupError(
                    f"cannot bind a client to {address} ({exc}); the demo needs the whole "
                    "127.0.0.0/8 on the loopback interface, as Linux has it"
                ) from exc


def check_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise SetupError(f"Redis at {redacted(url)} does not answer: {exc}") from exc
    finally:
        client.close()


def run_command(args: Sequence[str], env: Mapping[str, str], *, stdout_only: bool = False) -> str:
    try:
        done = subprocess.run(
            [PYTHON, *args],
            cwd=REPO_DIR,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise SetupError(f"{' '.join(args)} took longer than {COMMAND_TIMEOUT:g} s") from exc
    if done.returncode != 0:
        raise SetupError(
            f"{' '.join(args)} failed with exit status {done.returncode}:\n"
            f"{done.stdout}{done.stderr}".rstrip()
        )
    return (done.stdout if stdout_only else done.stdout + done.stderr).strip()


def seed_users(env: Mapping[str, str]) -> dict[str, str]:
    """Create the API users; return their DRF tokens (never printed)."""
    output = run_command(["manage.py", "seed_users", "--json", *USERS], env, stdout_only=True)
    try:
        tokens = json.loads(output.splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise SetupError(f"seed_users printed no tokens: {output!r}") from exc
    missing = [user for user in USERS if user not in tokens]
    if missing:
        raise SetupError(f"seed_users made no token for {missing}")
    return {str(user): str(token) for user, token in tokens.items()}


def prepare_database(env: Mapping[str, str]) -> dict[str, str]:
    """Migrate and seed the database (items and the API users); return the users' tokens."""
    print("Migrating and seeding the database ...")
    run_command(["manage.py", "migrate", "--noinput", "--verbosity", "0"], env)
    say(run_command(["manage.py", "seed_items"], env), "  ", "    ")
    tokens = seed_users(env)
    say(f"API users {', '.join(USERS)}, each with a DRF token", "  ", "    ")
    return tokens


def gunicorn_supports_no_control_socket() -> bool:
    config = importlib.import_module("gunicorn.config")  # untyped: no stubs for gunicorn
    return "control_socket_disable" in config.Config().settings


def ask_workers(url: str, parallel: int, read: Callable[[Any], T]) -> dict[int, T]:
    """GET ``url`` over ``parallel`` connections at once; return, by pid, what ``read``
    makes of each answering worker's JSON (an answer it cannot read is left out).

    Each sync worker answers one connection at a time, so parallel requests reach
    several workers."""
    found: dict[int, T] = {}
    lock = threading.Lock()

    def one() -> None:
        with requests.Session() as session:
            session.trust_env = False
            try:
                response = session.get(url, timeout=(0.5, 5.0))
                payload = response.json()
                pid = int(payload["pid"])
                value = read(payload)
            except (requests.RequestException, ValueError, KeyError, TypeError):
                return
        with lock:
            found[pid] = value

    threads = [threading.Thread(target=one, daemon=True) for _ in range(parallel)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(6.0)
    return found


class Server:
    """A gunicorn master serving the example project, started and stopped by the demo."""

    def __init__(self, env: Mapping[str, str], workers: int, log_path: Path) -> None:
        self.env = dict(env)
        self.workers = workers
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.base_url = ""
        self.pids: set[int] = set()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):
            port = free_port()
            self._spawn(port)
            if self._wait_ready(port):
                self.base_url = f"http://127.0.0.1:{port}"
                return
            if self.process is not None and self.process.poll() is None:
                break  # running but not answering: retrying another port will not help
            if "Address already in use" not in self.log_tail():
                break
        self.stop()
        raise SetupError(f"gunicorn did not become ready; its log says:\n{self.log_tail()}")

    def _spawn(self, port: int) -> None:
        args = [
            PYTHON,
            "-m",
            "gunicorn",
            "example_project.wsgi:application",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            str(self.workers),
            "--worker-class",
            "sync",
            "--timeout",
            "30",
            "--graceful-timeout",
            "5",
            "--chdir",
            str(REPO_DIR),
            "--error-logfile",
            "-",
            "--log-level",
            "info",
        ]
        if gunicorn_supports_no_control_socket():
            args.append("--no-control-socket")
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                args,
                cwd=REPO_DIR,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: Ctrl-C reaches only us
            )

    def _wait_ready(self, port: int) -> bool:
        """Wait until every worker has answered ``/healthz`` (each reports its pid)."""
        url = f"http://127.0.0.1:{port}/healthz"
        deadline = time.monotonic() + STARTUP_TIMEOUT
        answered = False
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            pids = set(ask_workers(url, 2 * self.workers, lambda payload: None))
            answered = answered or bool(pids)
            self.pids |= pids
            if len(self.pids) >= self.workers:
                return True
            time.sleep(0.1)
        if answered:
            say(
                f"warning: only {len(self.pids)} of {self.workers} workers answered before the "
                "start; the others may be slow to warm up"
            )
        return answered

    def stop(self) -> int | None:
        """Stop gunicorn gracefully (SIGTERM), then by force; return its exit status."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                # The master and its workers share the process group the demo created.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        return process.returncode

    def collect_stats(self, timeout: float = STATS_TIMEOUT) -> dict[int, list[dict[str, Any]]]:
        """Every worker's decision counts (``GET /api/quota-stats/``), by pid.

        It asks until every worker seen at the start has answered (the counts no longer
        change: the clients have stopped) or ``timeout`` passes.
        """
        url = self.base_url + STATS_PATH
        found: dict[int, list[dict[str, Any]]] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.pids <= set(found):
            found.update(
                ask_workers(url, 2 * self.workers, lambda payload: list(payload["outcomes"]))
            )
            if not self.pids <= set(found):
                time.sleep(0.05)
        return found

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_problems(self) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        keys = ("Traceback", "[ERROR]", "[CRITICAL]", "WORKER TIMEOUT")
        return [line for line in text.splitlines() if any(k in line for k in keys)]
