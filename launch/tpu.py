#!/usr/bin/env python
"""Launch podracer: `python launch/tpu.py --arch=anakin --algo=ppo` (see --help)."""

import os
import sys

try:
    import podracer  # noqa: F401
except ImportError:  # run from a checkout that was not pip-installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from podracer.command import main

if __name__ == "__main__":
    sys.exit(main())
