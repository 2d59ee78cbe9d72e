"""``python -m benchmarks.gpu_check`` (``make gpu-check``): see ``benchmarks.gpu_check.run``."""

import sys

from benchmarks.gpu_check.run import main

if __name__ == "__main__":
    sys.exit(main())
