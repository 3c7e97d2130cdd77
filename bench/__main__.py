"""``python -m bench``: every benchmark, then BENCHMARKS.md (see bench/run_all.py)."""

import sys

from bench.run_all import main

sys.exit(main())
