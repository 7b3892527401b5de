#!/usr/bin/env bash
# Every bench row that makes sense on one GPU or TPU host, in under 10 minutes;
# one JSON file of results that names the device (bench/accelerator.py says what
# each row is).
#
#   bash bench/accelerator.sh                       # on the accelerator host
#   bash bench/accelerator.sh --out /tmp/gpu.json   # results elsewhere
#   bash bench/accelerator.sh --dry                 # tiny CartPole rows on any machine (tested)
set -euo pipefail
cd "$(dirname "$0")/.."
# Every row is its own process, started the way a user starts one.
exec "${PYTHON:-$(command -v python || command -v python3)}" bench/accelerator.py "$@"
