"""The evaluation script specialised per policy shape, generated from ``evaluate.lua``
(docs/architecture.md#the-script-protocol).

``evaluate.lua`` is the general script: it decides any group, and runs as it is. The
common call, one policy with one window, runs a variant of it per algorithm, made here
from the same file by the comments it carries (its header describes them):

* a line ``--@ if EXPR`` (then ``--@ elif EXPR``, ``--@ else``, ``--@ end``) keeps the
  lines up to the next such line only in the scripts where ``EXPR`` holds;
* ``--@ EXPR`` at the end of a line of code keeps that line only there;
* a line ``--+ code`` is code of the variants only (a Lua comment in the general script).

``EXPR`` is names joined by ``or``: ``general`` (the general script) and the four
algorithms, each true in the general script and in its own variant. A variant keeps the
general script's KEYS, ARGV, reply and writes; it drops the loops over policies and
windows, the dispatch on the algorithm and the other algorithms' code.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator, Mapping
from types import MappingProxyType
from typing import Final

from django_quota.core.policy import ALGORITHMS, CONCURRENCY

#: What names the general script in a condition.
GENERAL = "general"
#: The names a condition may use.
CONDITION_NAMES = frozenset((GENERAL, *ALGORITHMS))

#: The script deciding one policy with one window, by the policy's algorithm.
SINGLE_WINDOW_SCRIPTS: Mapping[str, str] = MappingProxyType(
    {algorithm: f"evaluate_{algorithm}" for algorithm in ALGORITHMS if algorithm != CONCURRENCY}
)


class Marks:
    """The shape comments of ``evaluate.lua``, as patterns."""

    #: A line ``--@ if <names>`` (``elif``, ``else``, ``end``) opening or closing a block.
    DIRECTIVE: Final = re.compile(r"^\s*--@\s*(?P<word>if|elif|else|end)\b\s*(?P<expr>.*)$")
    #: A line of code ending ``--@ <names>``: kept only in those shapes.
    SUFFIX: Final = re.compile(r"^(?P<code>.*?)\s+--@ (?P<expr>\w+(?: or \w+)*)\s*$")
    #: A line ``--+ <code>``: code of the variants only (a comment in the general script).
    VARIANT_LINE: Final = re.compile(r"^(?P<indent>\s*)--\+ (?P<code>.*)$")


class ShapeError(ValueError):
    """The script's shape comments do not parse (an unknown name, an unbalanced block)."""


def _holds(expr: str, names: Collection[str], number: int) -> bool:
    """Whether the condition ``expr`` (names joined by ``or``) holds where ``names`` do."""
    terms = expr.split(" or ")
    for term in terms:
        if term not in CONDITION_NAMES:
            raise ShapeError(f"line {number}: {term!r} is not one of {sorted(CONDITION_NAMES)}")
    return any(term in names for term in terms)


def _lines(source: str, names: Collection[str]) -> Iterator[tuple[int, str, bool]]:
    """Each line of ``source`` that is not a directive, with whether it is kept where
    ``names`` hold (``--+`` and suffix comments still on it)."""
    # One entry per open block: whether its enclosing lines are kept, whether a branch
    # was taken, whether the current branch is kept.
    blocks: list[tuple[bool, bool, bool]] = []
    keep = True
    for number, line in enumerate(source.splitlines(), 1):
        directive = Marks.DIRECTIVE.match(line)
        if directive is None:
            yield number, line, keep
            continue
        word, expr = directive["word"], directive["expr"].strip()
        if word in ("if", "elif") and not expr:
            raise ShapeError(f"line {number}: {word} without a condition")
        if word in ("else", "end") and expr:
            raise ShapeError(f"line {number}: {word} takes no condition")
        if word == "if":
            holds = _holds(expr, names, number)
            blocks.append((keep, holds, keep and holds))
        else:
            if not blocks:
                raise ShapeError(f"line {number}: {word} outside an if")
            outer, taken, _ = blocks.pop()
            if word == "end":
                keep = outer
                continue
            holds = not taken and (word == "else" or _holds(expr, names, number))
            blocks.append((outer, taken or holds, outer and holds))
        keep = blocks[-1][2]
    if blocks:
        raise ShapeError("an if without its end")


def render(source: str, names: Collection[str]) -> str:
    """``source`` as the script where ``names`` hold: the lines kept, directives dropped,
    suffix conditions stripped, ``--+`` lines made code (dropped in the general script)."""
    general = GENERAL in names
    out = []
    for number, line, keep in _lines(source, names):
        variant_line = Marks.VARIANT_LINE.match(line)
        if variant_line is not None:
            if general:
                continue
            line = variant_line["indent"] + variant_line["code"]
        suffix = Marks.SUFFIX.match(line)
        if suffix is not None:
            keep = keep and _holds(suffix["expr"], names, number)
            line = suffix["code"].rstrip()
        if keep:
            out.append(line)
    return "\n".join(out) + "\n"


def single_window(source: str, algorithm: str) -> str:
    """The variant of ``evaluate.lua`` (``source``) deciding one ``algorithm`` policy with
    one window, opening with a header that says so."""
    if algorithm not in SINGLE_WINDOW_SCRIPTS:
        raise ShapeError(f"no algorithm named {algorithm!r}")
    name = SINGLE_WINDOW_SCRIPTS[algorithm]
    header = (
        f"-- {name}: evaluate.lua specialised to one {algorithm} policy with one window,\n"
        "-- generated from it by django_quota/scripts/shapes.py: the same KEYS, ARGV, reply\n"
        "-- and writes as the general script, whose header follows.\n"
    )
    return header + render(source, (algorithm,))


def check_general(source: str) -> None:
    """Raise :class:`ShapeError` unless ``source``, run as it is, is the general script:
    every line of code is kept where every name holds (a ``--+`` line is a comment)."""
    for number, line, keep in _lines(source, CONDITION_NAMES):
        suffix = Marks.SUFFIX.match(line)
        if Marks.VARIANT_LINE.match(line) is None and suffix is not None:
            keep = keep and _holds(suffix["expr"], CONDITION_NAMES, number)
        if not keep and Marks.VARIANT_LINE.match(line) is None:
            raise ShapeError(f"line {number} is not in the general script: {line.strip()}")
