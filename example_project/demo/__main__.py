"""Run the demo: ``python -m example_project.demo``, which ``scripts/demo`` runs."""

from __future__ import annotations

import sys

from example_project.demo.cli import main

sys.exit(main())
