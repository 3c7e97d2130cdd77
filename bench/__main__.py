"""``python -m bench``: every benchmark, then BENCHMARKS.md (see bench/run.py)."""

import sys

from bench.run import main

sys.exit(main())
