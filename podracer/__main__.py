"""`python -m podracer ...` is `python launch/tpu.py ...`."""

import sys

from podracer.cli import main

sys.exit(main())
