"""docs/tutorial.md, run as written: the test reads the page, builds the project it
describes in a temporary directory, runs every command shown, and compares each
command's output with the output printed on the page.

How the page is read:

- every ```` ```console ```` block is run: a line starting with ``$ `` is a command, the
  lines after it, up to the next command, are its output;
- every fenced block with ``title="<path>"`` is a file, written at that path (relative to
  the directory the commands have reached); preceded by ``<!-- tutorial: append -->`` it
  is added to the end of the file instead;
- the table after ``<!-- tutorial: admin form -->`` is the admin form to fill in: the test
  logs in over HTTP as the user that ``createsuperuser`` created, opens the add page the
  text links, fills in each field named in the table (found by its label on the page),
  leaves every other field as the admin rendered it, and clicks Save, as a browser
  does; the admin's answer must carry the message that follows
  ``<!-- tutorial: admin message -->``.

What the test changes, because a test must:

- ``pip install`` is not run (the package is installed in this environment); ``cd`` moves
  the directory the next commands run in;
- Redis and the dev server listen on free loopback ports instead of 6379 and 8000: the
  text ``6379`` and ``127.0.0.1:8000`` in commands, files and the admin link is replaced
  by those ports, and the ports are mapped back in the outputs;
- ``redis-server ... --daemonize yes`` gets ``--pidfile <tmp>/redis.pid`` (so the test can
  stop the server it started if a later step fails, and no pid file is written under
  /var/run), and the next command waits until Redis accepts connections (a person's
  typing gives it that time);
- ``manage.py runserver`` gets the address ``127.0.0.1:<port>``; the page itself passes
  ``--noreload`` (one process, stopped by its id at the end, and the output the page
  shows). It runs in the background, its startup output is compared once it has printed
  as many lines as the page shows;
- commands run with ``bash -c`` in a clean environment: the venv's ``bin`` first on
  ``PATH`` (its ``python`` and ``django-admin``), no ``DJANGO_SETTINGS_MODULE`` from this
  test run, unbuffered Python output so that stdout and stderr interleave as in a
  terminal; their stdout and stderr are compared together.

What is normalised before comparing, on both sides (:func:`normalise`), and nothing else:

- line ends (``curl -i`` prints headers with CRLF) and trailing blanks;
- dates: the HTTP ``Date`` header and the dev server's start line;
- versions: Django's in the dev server's banner and its documentation link, Python's
  in the ``Server`` header (the page names the versions it was captured with: this test
  is skipped on older Django or DRF releases, whose output differs, and fails on newer
  ones until the page is captured again);
- timings: ``t=`` in ``RateLimit``, ``Retry-After``, the body's ``retry_after`` (which
  changes the ``Content-Length``), and ``quota inspect``'s reset time and TTL. These
  values are checked to lie within the policy's 60 seconds instead.

The pseudonym ``quota inspect`` prints is not normalised: it is derived from the page's
``HMAC_KEY`` and the client address, both fixed. Neither are the admin's revision (a fresh
database starts at 1) nor the migrations listed.
"""

from __future__ import annotations

import contextlib
import difflib
import html
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from http.cookiejar import CookieJar
from pathlib import Path

import pytest

from tests.conftest import IN_CI, require_redis_server
from tests.faults import free_port

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "tutorial.md"
PAGE_REDIS_PORT = "6379"
PAGE_ADDRESS = "127.0.0.1:8000"
#: Upper bound of every timing the outputs show: the policy's window is 60 s.
WINDOW_SECONDS = 60
COMMAND_TIMEOUT = 60.0
#: ``TUTORIAL_CAPTURE=<file>``: also write the page with this run's outputs there, to
#: review and copy over docs/tutorial.md after a change (the test still compares).
CAPTURE = os.environ.get("TUTORIAL_CAPTURE")
STARTUP_TIMEOUT = 20.0


# -- reading the page ------------------------------------------------------------------


@dataclass
class Command:
    line: str
    expected: str
    printed: str | None = None  # what this run printed, ports mapped back


@dataclass
class Console:
    commands: list[Command]


@dataclass
class File:
    path: str
    text: str
    append: bool


@dataclass
class AdminField:
    part: str
    label: str
    value: str
    typed: bool  # written in backticks: text typed in; otherwise a choice picked by name


@dataclass
class AdminForm:
    url: str
    fields: list[AdminField]
    message: str


Step = Console | File | AdminForm

FENCE_RE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
TITLE_RE = re.compile(r'title="(?P<title>[^"]+)"')
APPEND_MARKER = "<!-- tutorial: append -->"
FORM_MARKER = "<!-- tutorial: admin form -->"
MESSAGE_RE = re.compile(r'<!-- tutorial: admin message -->"(?P<message>[^"]+)"')
ADD_URL_RE = re.compile(r"<(?P<url>http://[^>]+/add/)>")
VERSIONS_RE = re.compile(
    r"Django (?P<django>\d+\.\d+)\.\d+, Django REST framework (?P<drf>\d+\.\d+)\.\d+"
)


def parse_console(body: str) -> Console:
    commands: list[Command] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            commands.append(Command(line[2:], ""))
        else:
            assert commands, f"console output before any command: {line!r}"
            commands[-1].expected += line + "\n"
    return Console(commands)


def parse_admin_form(page: str, start: int) -> AdminForm:
    rows: list[list[str]] = []
    for line in page[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    header, _rule, *body = rows
    assert header == ["part of the form", "field", "value"], header
    fields = [
        AdminField(part, label, value.strip("`"), value.startswith("`"))
        for part, label, value in body
    ]
    url = ADD_URL_RE.search(page[:start])
    message = MESSAGE_RE.search(page, start)
    assert url is not None and message is not None, "the admin step names no URL or message"
    return AdminForm(url["url"], fields, message["message"])


def parse_page(page: str) -> list[Step]:
    """The page's steps in reading order."""
    found: list[tuple[int, Step]] = []
    for fence in FENCE_RE.finditer(page):
        info = fence["info"].strip()
        title = TITLE_RE.search(info)
        if info == "console":
            found.append((fence.start(), parse_console(fence["body"])))
        elif title is not None:
            append = page[: fence.start()].rstrip().endswith(APPEND_MARKER)
            found.append((fence.start(), File(title["title"], fence["body"], append)))
    form_at = page.index(FORM_MARKER)
    found.append((form_at, parse_admin_form(page, form_at)))
    return [step for _, step in sorted(found, key=lambda pair: pair[0])]


# -- normalising outputs -----------------------------------------------------------------

#: (pattern, replacement): what must vary between runs, and only that.
NORMALISATIONS = [
    (re.compile(r"^Date: .*$", re.M), "Date: <date>"),
    (re.compile(r"^[A-Z][a-z]+ \d{2}, \d{4} - \d{2}:\d{2}:\d{2}$", re.M), "<date>"),
    (re.compile(r"Django version \d+\.\d+(\.\d+)?\w*"), "Django version <version>"),
    (re.compile(r"docs\.djangoproject\.com/en/\d+\.\d+/"), "docs.djangoproject.com/en/<version>/"),
    (re.compile(r"CPython/\d+\.\d+\.\d+"), "CPython/<version>"),
    (re.compile(r";t=\d+"), ";t=<seconds>"),
    (re.compile(r"^Retry-After: \d+$", re.M), "Retry-After: <seconds>"),
    (re.compile(r'"retry_after": ?\d+(\.\d+)?'), '"retry_after": <seconds>'),
    (re.compile(r"^Content-Length: \d+$", re.M), "Content-Length: <length>"),
    (re.compile(r"reset in \d+(\.\d+)? s, ttl \d+ ms"), "reset in <seconds> s, ttl <ms> ms"),
]

#: Timings whose values are checked to lie within the window (seconds; the TTL in ms).
TIMINGS_RE = re.compile(
    r";t=(?P<t>\d+)|^Retry-After: (?P<retry>\d+)$|\"retry_after\": ?(?P<body>[\d.]+)"
    r"|reset in (?P<reset>[\d.]+) s, ttl (?P<ttl>\d+) ms",
    re.M,
)


def normalise(text: str) -> str:
    text = text.replace("\r\n", "\n")
    for pattern, replacement in NORMALISATIONS:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


def timings_out_of_bounds(text: str) -> list[str]:
    wrong = []
    for match in TIMINGS_RE.finditer(text):
        for name, value in match.groupdict().items():
            if value is None:
                continue
            number = float(value) / (1000 if name == "ttl" else 1)
            # A TTL may outlive the window a little (docs/settings.md: CLEANUP_GRACE).
            limit = WINDOW_SECONDS + (2 if name == "ttl" else 0)
            if not 0 <= number <= limit:
                wrong.append(f"{name}={value}")
    return wrong


# -- the admin form, as a browser reads it -----------------------------------------------


@dataclass
class Select:
    options: list[tuple[str, str]] = field(default_factory=list)  # (value, text)
    selected: str | None = None


class FormReader(HTMLParser):
    """The fields of one form (their values as rendered), its labels and column heads."""

    def __init__(self, form_id: str) -> None:
        super().__init__()
        self.form_id = form_id
        self.inside = False
        self.values: dict[str, str] = {}
        self.selects: dict[str, Select] = {}
        self.labels: dict[str, str] = {}  # label text -> the id it is for
        self.column_heads: list[str] = []
        self._text: list[str] | None = None
        self._closing = ""
        self._label_for = ""
        self._select = ""
        self._option: str | None = None
        self._textarea = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {name: value or "" for name, value in attrs}
        if tag == "form" and attributes.get("id") == self.form_id:
            self.inside = True
        if not self.inside:
            return
        name = attributes.get("name", "")
        if tag == "input" and name and "__prefix__" not in name:
            kind = attributes.get("type", "text")
            if kind == "checkbox":
                if "checked" in attributes:
                    self.values[name] = attributes.get("value") or "on"
            elif kind not in ("submit", "button", "image", "file"):
                self.values[name] = attributes.get("value", "")
        elif tag == "select" and name and "__prefix__" not in name:
            self._select = name
            self.selects[name] = Select()
        elif tag == "option" and self._select:
            self._option = attributes.get("value", "")
            if "selected" in attributes:
                self.selects[self._select].selected = self._option
            self._start_text("option")
        elif tag == "textarea" and name and "__prefix__" not in name:
            self._textarea = name
            self._start_text("textarea")
        elif tag == "label":
            self._label_for = attributes.get("for", "")
            self._start_text("label")
        elif tag == "th":
            self._start_text("th")

    def _start_text(self, closing: str) -> None:
        self._text, self._closing = [], closing

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self.inside = False
        if tag == "select":
            self._select = ""
        if self._text is None or tag != self._closing:
            return
        text = "".join(self._text)
        self._text = None
        if tag == "option" and self._select and self._option is not None:
            self.selects[self._select].options.append((self._option, text.strip()))
        elif tag == "textarea":
            # The HTML spec drops one newline right after <textarea>.
            self.values[self._textarea] = text[1:] if text.startswith("\n") else text
        elif tag == "label" and self._label_for:
            self.labels[text.strip().rstrip(":")] = self._label_for
        elif tag == "th":
            self.column_heads.append(" ".join(text.split()))

    def form_data(self) -> dict[str, str]:
        data = dict(self.values)
        for name, select in self.selects.items():
            default = select.options[0][0] if select.options else ""
            data[name] = select.selected if select.selected is not None else default
        return data


def hidden_value(page: str, name: str) -> str:
    match = re.search(rf'name="{name}" value="(?P<value>[^"]*)"', page)
    assert match is not None, f"no {name} on the page"
    return match["value"]


def add_policy_in_admin(form: AdminForm, base_url: str, username: str, password: str) -> str:
    """Log in, fill in the add form as the page says, save: the admin's answer, as text."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))

    def get(url: str) -> str:
        with opener.open(url, timeout=10) as response:
            return str(response.read().decode())

    def post(url: str, data: dict[str, str]) -> tuple[str, str]:
        body = urllib.parse.urlencode(data).encode()
        with opener.open(url, data=body, timeout=10) as response:
            return response.geturl(), str(response.read().decode())

    login_url = f"{base_url}/admin/login/?next=/admin/"
    login_page = get(login_url)
    landed, _ = post(login_url, {
        "csrfmiddlewaretoken": hidden_value(login_page, "csrfmiddlewaretoken"),
        "username": username,
        "password": password,
        "next": "/admin/",
    })
    assert landed == f"{base_url}/admin/", f"the login did not succeed: {landed}"

    add_url = form.url.replace(f"http://{PAGE_ADDRESS}", base_url)
    reader = FormReader("quotapolicy_form")
    reader.feed(get(add_url))
    data = reader.form_data()
    assert data, "the add page has no quotapolicy_form"
    for row in form.fields:
        if row.part.startswith("Quota windows"):
            # Inline rows: the column head names the field; the first row is number 0.
            assert row.label in reader.column_heads, (row.label, reader.column_heads)
            name = f"windows-0-{row.label.lower().replace(' ', '_')}"
        else:
            assert row.part == "Quota policy", row.part
            assert row.label in reader.labels, (row.label, sorted(reader.labels))
            name = reader.labels[row.label].removeprefix("id_")
        assert name in data, (name, sorted(data))
        if row.typed:
            data[name] = row.value
        else:
            choices = {text: value for value, text in reader.selects[name].options}
            assert row.value in choices, (row.value, choices)
            data[name] = choices[row.value]
    data["_save"] = "Save"
    landed, answer = post(add_url, data)
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", answer)).split())
    assert landed.endswith("/admin/django_quota/quotapolicy/"), (
        f"the admin did not save the policy (still at {landed}):\n{text[:3000]}"
    )
    return text


# -- running the commands ----------------------------------------------------------------


def require_program(name: str) -> None:
    if shutil.which(name) is None:
        if IN_CI:
            pytest.fail(f"{name} not found; in CI the tutorial test needs it")
        pytest.skip(f"{name} not found")


def wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Tutorial:
    """The directory, the environment and the background processes of one run."""

    def __init__(self, directory: Path) -> None:
        self.cwd = directory
        self.directory = directory
        self.redis_port = free_port()
        self.http_port = free_port()
        self.redis_pidfile = directory / "redis.pid"
        self.server: subprocess.Popen[bytes] | None = None
        self.server_log = directory / "runserver.log"
        self.wait_for_redis = False
        self.mismatches: list[str] = []
        self.env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "REDIS_URL")
        }
        self.env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
        self.env["PYTHONUNBUFFERED"] = "1"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def substitute(self, text: str) -> str:
        return text.replace(PAGE_REDIS_PORT, str(self.redis_port)).replace(
            PAGE_ADDRESS, f"127.0.0.1:{self.http_port}"
        )

    def unsubstitute(self, text: str) -> str:
        return text.replace(f"127.0.0.1:{self.http_port}", PAGE_ADDRESS).replace(
            f"127.0.0.1:{self.redis_port}", f"127.0.0.1:{PAGE_REDIS_PORT}"
        )

    def write(self, step: File) -> None:
        path = self.cwd / step.path
        assert path.parent.is_dir(), f"{step.path}: its directory does not exist"
        text = self.substitute(step.text)
        if step.append:
            assert path.is_file(), f"{step.path}: nothing to append to"
            text = path.read_text() + "\n" + text
        path.write_text(text)

    def compare(self, command: Command, actual: str) -> None:
        actual = command.printed = self.unsubstitute(actual)
        expected = command.expected
        wrong = timings_out_of_bounds(actual)
        if wrong:
            self.mismatches.append(
                f"$ {command.line}\ntimings outside the window: {wrong}\n{actual}"
            )
        if normalise(expected) != normalise(actual):
            diff = "\n".join(
                difflib.unified_diff(
                    normalise(expected).splitlines(),
                    normalise(actual).splitlines(),
                    "the page",
                    "this run",
                    lineterm="",
                )
            )
            self.mismatches.append(
                f"$ {command.line}\n{diff}\n--- what this run printed, as is:\n{actual}"
            )

    def run(self, command: Command) -> None:
        line = command.line
        if line.startswith(("pip install", "python -m pip install")):
            assert not command.expected.strip(), "the page shows output for pip install"
            return
        if line.startswith("cd "):
            self.cwd = self.cwd / line[3:].strip()
            return
        if "runserver" in line.split():
            self.start_server(command)
            return
        line = self.substitute(line)
        daemon = "redis-server" in line.split() and "--daemonize yes" in line
        if daemon:
            line += f" --pidfile {self.redis_pidfile}"
        if self.wait_for_redis:
            wait_for_port(self.redis_port, STARTUP_TIMEOUT)
            self.wait_for_redis = False
        result = subprocess.run(
            ["bash", "-c", line], cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=COMMAND_TIMEOUT, check=False,
        )
        self.wait_for_redis = daemon
        output = result.stdout
        if result.returncode != 0:
            output += f"[exit status {result.returncode}]\n"
        self.compare(command, output)

    def start_server(self, command: Command) -> None:
        # Without --noreload the autoreloader's child would serve and the output would
        # start with its own line: the page shows the command as it is run here.
        assert "--noreload" in command.line.split(), f"the page runs {command.line!r}"
        line = f"{command.line} 127.0.0.1:{self.http_port}"
        with self.server_log.open("wb") as log:
            self.server = subprocess.Popen(
                ["bash", "-c", f"exec {line}"], cwd=self.cwd, env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        wait_for_port(self.http_port, STARTUP_TIMEOUT)
        wanted = len(normalise(command.expected).splitlines())
        deadline = time.monotonic() + STARTUP_TIMEOUT
        printed, quiet_since = "", time.monotonic()
        while time.monotonic() < deadline:
            now = self.server_log.read_text()
            if now != printed:
                printed, quiet_since = now, time.monotonic()
            if CAPTURE is None and len(printed.splitlines()) >= wanted:
                break
            if CAPTURE is not None and time.monotonic() - quiet_since > 1:
                break  # capturing: all that the server prints before it serves
            time.sleep(0.05)
        if CAPTURE is None:
            printed = "".join(printed.splitlines(keepends=True)[:wanted])
        self.compare(command, printed)

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            self.server.wait(timeout=10)
        if self.redis_pidfile.is_file():  # Redis removes it on a clean shutdown
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(self.redis_pidfile.read_text()), signal.SIGTERM)


@pytest.fixture
def tutorial(tmp_path: Path) -> Iterator[Tutorial]:
    require_redis_server()
    for program in ("redis-cli", "curl", "bash"):
        require_program(program)
    run = Tutorial(tmp_path)
    try:
        yield run
    finally:
        run.stop()


def superuser(steps: list[Step]) -> tuple[str, str]:
    """The user and password the page's ``createsuperuser`` command creates."""
    for step in steps:
        for command in step.commands if isinstance(step, Console) else []:
            if "createsuperuser" in command.line:
                password = re.search(r"DJANGO_SUPERUSER_PASSWORD=(\S+)", command.line)
                username = re.search(r"--username (\S+)", command.line)
                assert password and username, command.line
                return username[1], password[1]
    raise AssertionError("the page creates no superuser")


def test_the_tutorial_prints_what_the_page_shows(tutorial: Tutorial) -> None:
    import django
    import rest_framework

    page = PAGE.read_text()
    versions = VERSIONS_RE.search(page)
    assert versions is not None, "the page names no versions"
    installed = {
        "django": tuple(django.VERSION[:2]),
        "drf": tuple(int(part) for part in rest_framework.VERSION.split(".")[:2]),
    }
    for package, version in installed.items():
        captured = tuple(int(part) for part in versions[package].split("."))
        if version < captured:
            # The oldest-versions lane: the outputs shown are those of the versions named.
            pytest.skip(f"the page was captured on {package} {versions[package]}; this is older")

    steps = parse_page(page)
    # What the page is for, so that an emptied page cannot pass: the refusal and the
    # counters read back.
    commands = [command for step in steps if isinstance(step, Console) for command in step.commands]
    assert any("HTTP/1.1 429 Too Many Requests" in command.expected for command in commands)
    assert any("quota inspect" in command.line for command in commands)
    username, password = superuser(steps)
    for step in steps:
        if isinstance(step, Console):
            for command in step.commands:
                tutorial.run(command)
        elif isinstance(step, File):
            tutorial.write(step)
        else:
            answer = add_policy_in_admin(step, tutorial.base_url, username, password)
            if step.message not in answer:
                tutorial.mismatches.append(
                    f"the admin's answer lacks {step.message!r}:\n{answer[:3000]}"
                )
    if CAPTURE is not None:
        Path(CAPTURE).write_text(captured_page(page, steps))
    assert not tutorial.mismatches, "\n\n".join(tutorial.mismatches)


def captured_page(page: str, steps: list[Step]) -> str:
    """The page with each console block's outputs replaced by what this run printed."""
    consoles = iter(step for step in steps if isinstance(step, Console))

    def replace(fence: re.Match[str]) -> str:
        if fence["info"].strip() != "console":
            return fence[0]
        lines = []
        for command in next(consoles).commands:
            output = command.expected if command.printed is None else command.printed
            lines.append(f"$ {command.line}\n" + output.replace("\r\n", "\n").rstrip())
        body = "\n".join(line.rstrip("\n") for line in lines)
        return f"```console\n{body}\n```"

    return FENCE_RE.sub(replace, page)
