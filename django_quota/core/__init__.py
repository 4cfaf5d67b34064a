"""The pure core of django-quota: rates, policies, subjects, arithmetic and outcomes.

Nothing in this package imports Django, redis-py or any I/O library; the import-linter
contract in ``pyproject.toml`` and ``tests/test_layers.py`` keep it that way.
"""
