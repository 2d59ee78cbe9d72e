"""``python -m benchmarks.scale``: the prediction of ``benchmarks.scale.run``."""

import sys

from benchmarks.scale.run import main

if __name__ == "__main__":
    sys.exit(main())
