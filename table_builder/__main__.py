"""``python -m table_builder`` is ``ppd-table``."""

import sys

from table_builder.cli import main

sys.exit(main())
