"""`python -m podracer ...` is `python launch/tpu.py ...`."""

import sys

from podracer.command import main

sys.exit(main())
