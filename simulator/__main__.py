"""``python -m simulator``: the ``ppd-sim`` command line."""

from simulator.cli import main

raise SystemExit(main())
