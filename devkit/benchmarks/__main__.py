"""ops/bench <scenario>|all [--quick]: see devkit/benchmarks/runner.py and docs/benchmarks.md."""
import sys

from .runner import main

sys.exit(main())
