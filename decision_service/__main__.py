"""`python -m decision_service serve ...` (same as `ppd-decision`)."""

import sys

from decision_service.cli import main

sys.exit(main())
