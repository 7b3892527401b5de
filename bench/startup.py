"""Start-up: the default run's process wall time, cold and warm, against the peer's.

Each run is a new process, timed from its start to its exit by this one (the
interpreter itself is started directly, not through a shim such as pyenv's):

- podracer cold: `python launch/tpu.py` (Anakin PPO, CartPole-v1, 500k steps)
  with an empty compilation cache (`--compile-cache=` a new directory);
- podracer warm: the same command again, with the cache the cold run filled;
- peer: `python bench/peer_purejaxrl.py`, the single-file JAX PPO's own
  500k-step run, as its script runs (no compilation cache);
- peer warm: the peer again with JAX's persistent cache at JAX's own
  thresholds (`JAX_COMPILATION_CACHE_DIR`), after a run that filled it.

For podracer the summary's `time_to_first_step_s` (process start to the start
of training), `compile_s` and `train_s` are shown too, and every run's CPU
seconds (user + system, from `wait4`), which a busy machine inflates less than
wall time. Each figure is the median over `--repeats` rounds; one round runs
each kind once, in turn, so that all of them see the same machine.

    python bench/startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import common  # noqa: F401  (puts the repository on sys.path)

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
TARGETS = {"cold": 8.0, "warm": 5.0}  # our goals, seconds of process wall on a 2-core CPU


def _timed_process(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one process, from its start to its exit."""
    start = time.perf_counter()
    process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    out, err = process.stdout.read(), process.stderr.read()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"{' '.join(args)} failed ({process.returncode}):\n{err.decode()[-2000:]}")
    del out
    return wall, usage.ru_utime + usage.ru_stime


def podracer_run(run_dir: str, cache: str) -> dict:
    wall, cpu = _timed_process([sys.executable, os.path.join(ROOT, "launch", "tpu.py"), f"--run-dir={run_dir}",
                                f"--compile-cache={cache}"], dict(os.environ))
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return {"wall_s": wall, "cpu_s": cpu, "time_to_first_step_s": summary["time_to_first_step_s"],
            "compile_s": summary["compile_s"], "train_s": summary["train_s"],
            "hit": summary["compile_cache"]["hit"], "return": summary["episode_return_mean"]}


def peer_run(cache: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    if cache:
        env["JAX_COMPILATION_CACHE_DIR"] = cache
    wall, cpu = _timed_process([sys.executable, os.path.join(BENCH, "peer_purejaxrl.py")], env)
    return {"wall_s": wall, "cpu_s": cpu}


def _median(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if run.get(key) is not None]
    return statistics.median(values) if values else None


def _shown(runs: list[dict], key: str) -> str:
    values = [run[key] for run in runs if run.get(key) is not None]
    if not values:
        return "-"
    spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.2f}{spread}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every kind of run")
    args = parser.parse_args()
    runs = {"podracer cold": [], "podracer warm": [], "peer": [], "peer warm": []}
    with tempfile.TemporaryDirectory(prefix="podracer-startup-") as tmp:
        for repeat in range(args.repeats):
            cache, peer_cache = os.path.join(tmp, f"cache-{repeat}"), os.path.join(tmp, f"peer-cache-{repeat}")
            runs["podracer cold"].append(podracer_run(os.path.join(tmp, f"cold-{repeat}"), cache))
            runs["peer"].append(peer_run(None))
            runs["podracer warm"].append(podracer_run(os.path.join(tmp, f"warm-{repeat}"), cache))
            peer_run(peer_cache)  # fills the peer's cache
            runs["peer warm"].append(peer_run(peer_cache))
    assert not any(run["hit"] for run in runs["podracer cold"]), "a cold run read from the cache"
    assert all(run["hit"] for run in runs["podracer warm"]), "a warm run compiled something"
    keys = ("wall_s", "cpu_s", "time_to_first_step_s", "compile_s", "train_s")
    rows = [(name, *(_shown(kind, key) for key in keys)) for name, kind in runs.items()]
    result = {
        "cold_wall_s": _median(runs["podracer cold"], "wall_s"),
        "warm_wall_s": _median(runs["podracer warm"], "wall_s"),
        "cold_time_to_first_step_s": _median(runs["podracer cold"], "time_to_first_step_s"),
        "warm_time_to_first_step_s": _median(runs["podracer warm"], "time_to_first_step_s"),
        "cold_cpu_s": _median(runs["podracer cold"], "cpu_s"),
        "warm_cpu_s": _median(runs["podracer warm"], "cpu_s"),
        "train_s": _median(runs["podracer cold"] + runs["podracer warm"], "train_s"),
        "peer_wall_s": _median(runs["peer"], "wall_s"),
        "peer_warm_wall_s": _median(runs["peer warm"], "wall_s"),
        "return": _median(runs["podracer cold"] + runs["podracer warm"], "return"),
        "targets_wall_s": TARGETS,
        "repeats": args.repeats,
    }
    common.report(f"Start-up, 500k-step CartPole runs, median (min-max) of {args.repeats}", rows,
                  ("run", "wall s", "cpu s", "to first step s", "compile s", "train s"), result)


if __name__ == "__main__":
    main()
