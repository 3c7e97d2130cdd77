"""``python -m bench.cuda``: see the package's docstring."""

import os
import sys

from bench.cuda.cli import main

os.environ.setdefault("PYTHONUNBUFFERED", "1")
sys.exit(main())
