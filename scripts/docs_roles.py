"""A griffe extension for the API pages (mkdocs.yml loads it): the docstrings use
reStructuredText roles (``:func:`evaluate```, ``:class:`~django_quota.policies.Registry```)
that Markdown would print as they are. Each role becomes the object's name in code,
linked to its entry when the API pages render that object, plain code otherwise (an
optional cross-reference never fails the strict build). A paragraph ending in ``::`` (a
reStructuredText literal block follows) ends in ``:``; the indented block after it is
already a Markdown code block."""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj):`(?P<tilde>~?)(?P<target>[^`]+)`"
)
LITERAL_BLOCK_MARKER = re.compile(r"(?<=\S)::$", re.MULTILINE)


def resolve(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as seen from ``obj`` and its parents (``target`` itself
    when none of them knows its first name)."""
    target = target.rstrip("()")
    if target.startswith("django_quota"):
        return target
    first, _, rest = target.partition(".")
    try:
        found = obj.resolve(first)
    except griffe.NameResolutionError:
        return target
    return f"{found}.{rest}" if rest else found


def markdown(obj: griffe.Object, text: str) -> str:
    """``text`` with its roles as code spans that link where they can."""

    def replace(match: re.Match[str]) -> str:
        target = match["target"]
        shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
        identifier = html.escape(resolve(obj, target), quote=True)
        code = f"<code>{html.escape(shown)}</code>"
        return f'<autoref identifier="{identifier}" optional>{code}</autoref>'

    return LITERAL_BLOCK_MARKER.sub(":", ROLE.sub(replace, text))


class ReStructuredTextRoles(griffe.Extension):
    """Rewrite the roles of every docstring once the object tree is complete."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj, obj.docstring.value)
