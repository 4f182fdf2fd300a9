"""``python -m simulator``: the ``ppd-sim`` command line."""

from simulator.tools.cli import main

if __name__ == "__main__":  # not when multiprocessing's spawn re-imports this module in a child
    raise SystemExit(main())
