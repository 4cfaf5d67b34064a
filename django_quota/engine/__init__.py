"""The engine: what one settings generation decides with (docs/architecture.md).

- :mod:`~django_quota.engine.decisions`: the :class:`Limiter`, which prepares a group
  (identities, costs, keys, script arguments) and drives its one backend call;
- :mod:`~django_quota.engine.short_path`: the common call's short path, a base of the
  :class:`Limiter`;
- :mod:`~django_quota.engine.prepared`: policies compiled once per revision, and a
  prepared group;
- :mod:`~django_quota.engine.interpreting`: replies and failures into outcomes.
"""

from django_quota.engine.decisions import Clock, Limiter, Sizes, Subject, SubjectSource

__all__ = ["Clock", "Limiter", "Sizes", "Subject", "SubjectSource"]
