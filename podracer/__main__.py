"""`python -m podracer ...` is `python launch/tpu.py ...`."""

import sys

from podracer.orchestrate.cli import main

sys.exit(main())
