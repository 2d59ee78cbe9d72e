"""``python -m benchmarks.dynamic_2d``: the comparison of ``benchmarks.dynamic_2d.run``."""

from benchmarks.dynamic_2d.run import main

if __name__ == "__main__":
    main()
