"""What tests compare of a subprocess's output."""

from __future__ import annotations

import re

#: The warning a redis-py outside the fence's ``READ_AGAINST`` logs once per process
#: (``django_quota.backends.redispy.public_path``). ``test_redis_fence`` fails on such a
#: redis-py by name; the tests comparing a command's exact stderr leave the line out, so
#: that they do not fail with it.
UNREAD_REDIS_PY = re.compile(
    r"^quota: redis-py \S+ is not one django-quota's fast paths were read against .*\n",
    re.MULTILINE,
)


def without_unread_redis_py_warning(stderr: str) -> str:
    """``stderr`` without the line :data:`UNREAD_REDIS_PY` matches."""
    return UNREAD_REDIS_PY.sub("", stderr)
