"""Benchmarks: django-quota against its peers, on a redis-server this run starts itself.

Run with ``scripts/bench`` (or ``.venv/bin/python -m benchmarks --help``); see
``docs/benchmarks.md`` for what each column means. Nothing here is a test: speed and
memory are measured and printed as ratios against peers measured in the same run, never
asserted.
"""
