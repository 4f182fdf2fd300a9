import sys

from vllm_harness.cli import main

sys.exit(main())
