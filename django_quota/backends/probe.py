"""``quota check``'s probe, run the same way on every Redis backend: for each algorithm in
use, a peek and charges of a probe counter with the evaluation script, ``reset.lua``,
then the probe removed, so that the check fails whenever evaluations would
(``docs/operations.md``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from django_quota.backends import Backend
from django_quota.core.calls import CHARGED, UNCHARGED
from django_quota.core.errors import BackendError
from django_quota.core.protocol import GroupReply, Probe
from django_quota.scripts import all_scripts

Row = tuple[str, str, str]
NAME = "evaluation"


def _remaining(reply: GroupReply, expected: int) -> int | None:
    """The probe window's ``remaining`` when the reply decided with status ``expected``."""
    if reply.clock_unsafe or reply.indeterminate or reply.replayed or len(reply.results) != 1:
        return None
    result = reply.results[0]
    return result.windows[0].remaining if result.status == expected else None


def refused_command(error: BackendError) -> str | None:
    """The command a script could not run, read from the script's own line that Redis
    names in ``error`` when its ACL refused it, or None."""
    text = str(error)
    if "can't run this command" not in text:  # Redis's words for an ACL refusal in a script
        return None
    # Where Redis says which line of which script the refused command was on.
    found = re.search(r"script: ([0-9a-f]{40}), on @user_script:(\d+)", text)
    if found is None:
        return None
    sha1, line = found.group(1), int(found.group(2))
    for source in all_scripts():
        if source.sha1 == sha1:
            lines = source.source.splitlines()
            line_text = lines[line - 1] if 0 < line <= len(lines) else ""
            call = re.search(r"redis\.p?call\(\s*'([A-Za-z]+)'", line_text)
            return None if call is None else call.group(1).upper()
    return None


def _failed(step: str, probe: Probe, error: BackendError) -> Row:
    detail = f"{step} failed for {probe.algorithm} ({error.reason}): {error}"
    command = refused_command(error)
    if command is not None:
        detail += f" (the user may not run {command})"
    return (NAME, "error", detail)


def _evaluate(backend: Backend, probe: Probe) -> Row | None:
    """Peek and charge ``probe``'s counter: an ``error`` row, or None when every step
    decided as a healthy backend does."""
    try:
        peeked = _remaining(backend.evaluate(probe.peek), UNCHARGED)
        if peeked is not None and peeked != probe.limit:
            # Left by a check cut short within the last second: start it afresh.
            backend.reset(probe.counter, 1)
            peeked = _remaining(backend.evaluate(probe.peek), UNCHARGED)
    except BackendError as exc:
        return _failed("peek", probe, exc)
    if peeked != probe.limit:
        return (NAME, "error", f"peek of the {probe.algorithm} probe did not decide 'allowed'")
    for number, (charge, expected) in enumerate(probe.charges, 1):
        try:
            charged = _remaining(backend.evaluate(charge), CHARGED)
        except BackendError as exc:
            return _failed(f"charge {number}", probe, exc)
        if charged != expected:
            return (
                NAME,
                "error",
                f"charge {number} of the {probe.algorithm} probe left {charged} of "
                f"{probe.limit}, not {expected}",
            )
    try:
        backend.reset(probe.counter, 1)
    except BackendError as exc:
        return _failed("reset", probe, exc)
    return None


def run_probe(
    backend: Backend, probes: Sequence[Probe], delete: Callable[[str], object]
) -> Row:
    """The ``evaluation`` row: ``error`` when a step fails or decides otherwise than a
    healthy backend would (naming the command an ACL user may not run); ``warning`` when
    only the removal of a probe failed (it then expires by itself)."""
    for probe in probes:
        failed = _evaluate(backend, probe)
        if failed is not None:
            return failed
    for probe in probes:
        try:
            delete(probe.counter)  # reset.lua keeps the evaluation-id ledger by design
            left = backend.ttl_ms(probe.counter)
        except Exception as exc:
            return (NAME, "warning", f"the probe counter {probe.counter} was not removed: {exc}")
        if left != -2:
            return (NAME, "warning", f"the probe counter {probe.counter} is left ({left} ms)")
    done = ", ".join(
        probe.algorithm + (f" ({len(probe.charges)} charges, the list trimmed)"
                           if len(probe.charges) > 1 else "")
        for probe in probes
    )
    return (
        NAME,
        "ok",
        f"evaluate.lua peeked and charged a probe counter of each algorithm in use "
        f"({done}), reset.lua reset them, and they were removed",
    )
