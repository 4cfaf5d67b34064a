"""Limits written in the shop's code rather than in ``settings.QUOTA``.

Plain data, imported by the views and by the demo (``example_project/demo/``), which
replays them without loading Django.
"""

from __future__ import annotations

#: ``@quota`` on ``views.export``: per client IP, fixed windows, each request costing its
#: ``?size=`` (1 to ``EXPORT_MAX_SIZE`` pages) against both windows.
EXPORT_RATE: dict[str, str] = {"burst": "6/s", "sustained": "15/3s"}
EXPORT_MAX_SIZE = 3
#: Items per exported page.
EXPORT_PAGE_SIZE = 4
#: The id django-quota generates for a ``@quota(rate=...)`` policy:
#: ``view:<module>.<qualname>`` of the decorated view.
EXPORT_POLICY_ID = "view:example_project.shop.views.export"
