"""The package's one logger, ``django_quota``: every module logs through it
(``docs/operations.md``)."""

from __future__ import annotations

import logging

logger = logging.getLogger("django_quota")
