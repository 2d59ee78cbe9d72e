"""``python -m benchmarks.soak``: the soak run of ``benchmarks.soak.run``."""

import sys

from benchmarks.soak.run import main

if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
