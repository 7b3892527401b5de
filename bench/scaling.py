"""Scaling of every architecture x algorithm over devices and processes.

Each point is a real launcher run (`python launch/tpu.py ...`) with a fixed
global batch, so the work per step is the same and only the device split
changes: 1, 2, 4, 8 devices in one process, and 4 devices as 1 x 4 vs 2 x 2
processes joined by jax.distributed on loopback. The figure is the run's
`sps` from its summary.json (compilation excluded). Sebulba acts on device 0
of each process and learns on the others (on 1 device, both share it).

On a CPU-only machine every "device" shares the same cores, so this measures the
protocol's overhead (collectives, gloo between processes), not a speed-up.
Each run trains for a few seconds; the whole bench takes a few minutes.

    python bench/scaling.py [--scale 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import common

LAUNCHER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "tpu.py")

# Global sizes that split over every device count measured (Sebulba's 168
# environments over 1, 3 or 7 learner devices, and over 2 processes), each pair's
# environment, and its steps in one process and in two (whose collectives cross
# processes and are much slower on a CPU): a few seconds of training each.
PAIRS = {
    ("anakin", "ppo"): (["--env=CartPole-v1", "--num-envs=64", "--rollout-len=32"], 400_000, 40_000),
    ("anakin", "es"): (["--env=CartPole-v1", "--population=64"], 3_200_000, 1_600_000),
    ("sebulba", "ppo"): (["--env=CartPole-v1", "--num-envs=168", "--rollout-len=32"], 200_000, 60_000),
    ("sebulba", "es"): (["--env=CartPole-v1", "--population=64"], 400_000, 200_000),
}


def run_point(arch, algo, extra, devices, processes, total_steps) -> float | str:
    with tempfile.TemporaryDirectory() as run_dir:
        args = [sys.executable, LAUNCHER, f"--arch={arch}", f"--algo={algo}", *extra,
                f"--total-steps={total_steps}", f"--run-dir={run_dir}/run", "--checkpoint-every=0",
                f"--cpu-devices={devices // processes}"]
        if processes > 1:
            args.append(f"--num-processes={processes}")
        result = subprocess.run(args, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["failed"])[-1]
            return "n/a" if "must" in last or "split" in last else "failed"
        return json.loads(open(f"{run_dir}/run/summary.json").read())["sps"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every run's steps by this")
    parser.add_argument("--only", nargs="*", default=None, metavar="ARCH/ALGO",
                        help="measure only these rows, e.g. sebulba/es (default: all)")
    args = parser.parse_args()
    pairs = {pair: sizes for pair, sizes in PAIRS.items() if args.only is None or "/".join(pair) in args.only}
    points = [(d, 1) for d in (1, 2, 4, 8)] + [(4, 2)]
    rows, result = [], {"bench": "scaling", "sps": {}}
    for (arch, algo), (extra, one_process_steps, two_process_steps) in pairs.items():
        row = [f"{arch} {algo}"]
        for devices, processes in points:
            steps = one_process_steps if processes == 1 else two_process_steps
            sps = run_point(arch, algo, extra, devices, processes, int(steps * args.scale))
            result["sps"][f"{arch}/{algo}/{processes}x{devices // processes}"] = sps
            row.append(f"{sps:,.0f}" if isinstance(sps, float) else sps)
        rows.append(tuple(row))
    header = ("run", *(f"{p} x {d // p} dev" for d, p in points))
    common.report("Steps/s by processes x devices per process (global batch fixed)", rows, header, result)


if __name__ == "__main__":
    main()
