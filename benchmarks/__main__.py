"""``python -m benchmarks``: see :mod:`benchmarks.run`."""

import sys

from benchmarks.run import main

try:
    raise SystemExit(main())
except KeyboardInterrupt:
    print("interrupted: redis-server stopped", file=sys.stderr)
    raise SystemExit(130) from None
except TimeoutError as exc:
    print(f"{exc}: redis-server stopped", file=sys.stderr)
    raise SystemExit(124) from None
