"""Every bench row that makes sense on one accelerator host, in under 10 minutes.

Each row is a run of the launcher as a user would start it (`launch/tpu.py`,
its own process, a time limit of its own), at the sizes an accelerator is
bought for: Anakin PPO and IMPALA on CartPole with large batches, a population
of 256 agents, ES with 4,096 members, brax and Craftax, Sebulba Pong on the
host's cores, then PQN on MinAtar Breakout, SAC on brax and MuZero on
CartPole, and last three bench scripts: `bench/offpolicy.py`'s PQN
(MinAtar Breakout, against purejaxql's) and SAC (against brax's trainer) rows,
and `bench/envs.py`'s Jumanji rows (raw environment and PPO steps/s). Rows
past `--budget-s` are listed as not run; `--only` picks rows by name. Brax's
own PPO trainer runs beside podracer's brax row with the same environment,
batch and networks. A row reports the run's `sps` (env steps
over training time, compilation excluded), `steady_sps` (the same after the
first logged interval), `compile_s` and the final mean return.

    bash bench/accelerator.sh [--dry] [--only NAME ...] [--out results.json]

`--dry` runs the CartPole rows at tiny sizes on any machine (the tests do) and
skips the suites. The results file names the device; the last line printed is
the same JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO, "launch", "tpu.py")

# (name, flags on the accelerator, flags for --dry or None to skip it there, seconds allowed),
# in the order they run: the headline rows first, in case the host is taken back early.
ROWS: list[tuple[str, list[str], list[str] | None, int]] = [
    ("anakin-ppo-cartpole-16k-envs",
     ["--env=CartPole-v1", "--num-envs=16384", "--rollout-len=32", "--updates-per-call=8",
      "--total-steps=150000000"],
     ["--env=CartPole-v1", "--num-envs=64", "--rollout-len=16", "--updates-per-call=2",
      "--total-steps=4096"], 75),
    ("anakin-ppo-cartpole-preset",
     ["--env=CartPole-v1"],
     ["--env=CartPole-v1", "--total-steps=4096"], 45),
    ("anakin-ppo-cartpole-256-agents",
     ["--env=CartPole-v1", "--num-seeds=256", "--total-steps=500000"],
     ["--env=CartPole-v1", "--num-seeds=2", "--cpu-devices=1", "--total-steps=4096"], 75),
    ("anakin-es-cartpole-4096-members",
     ["--algo=es", "--env=CartPole-v1", "--population=4096", "--generations-per-call=5",
      "--total-steps=60000000"],
     ["--algo=es", "--env=CartPole-v1", "--population=8", "--generations-per-call=1",
      "--cpu-devices=1", "--total-steps=4000"], 60),
    ("anakin-ppo-craftax-classic-1k-envs",
     ["--env=craftax:Craftax-Classic-Symbolic-v1", "--num-envs=1024", "--rollout-len=64",
      "--updates-per-call=4", "--total-steps=10000000"],
     None, 90),
    ("anakin-ppo-brax-ant-4k-envs",
     ["--env=brax:ant", "--num-envs=4096", "--rollout-len=16", "--minibatches=16",
      "--updates-per-call=4", "--hidden", "64", "64", "--total-steps=20000000"],
     None, 90),
    ("anakin-impala-cartpole-16k-envs",
     ["--algo=impala", "--env=CartPole-v1", "--num-envs=16384", "--rollout-len=32",
      "--updates-per-call=8", "--total-steps=100000000"],
     ["--algo=impala", "--env=CartPole-v1", "--num-envs=64", "--rollout-len=16",
      "--updates-per-call=2", "--total-steps=4096"], 60),
    ("sebulba-ppo-pong",
     ["--arch=sebulba", "--env=Pong-v5", "--num-envs=64", "--actor-threads=2", "--env-threads=4",
      "--total-steps=1000000"],
     None, 60),
    # The value-based and search agents last: each runs if the budget has room left.
    ("anakin-pqn-breakout-minatar-1k-envs",
     ["--algo=pqn", "--env=Breakout-MinAtar", "--num-envs=1024", "--total-steps=20000000"],
     ["--algo=pqn", "--env=CartPole-v1", "--num-envs=16", "--rollout-len=16", "--minibatches=4",
      "--total-steps=2048"], 60),
    ("anakin-sac-brax-inverted-pendulum",
     ["--algo=sac", "--env=brax:inverted_pendulum", "--total-steps=200000"],
     None, 45),
    ("anakin-muzero-cartpole-preset",
     ["--algo=muzero", "--env=CartPole-v1"],
     ["--algo=muzero", "--env=CartPole-v1", "--updates-per-call=2", "--total-steps=512"], 60),
]
COMMON = ["--checkpoint-every=0", "--compile-cache=off"]

# Bench scripts run whole, after the launcher rows: (name, the script and its flags,
# the same for --dry or None, seconds allowed). A row keeps the script's last line,
# its JSON result.
SCRIPT_ROWS: list[tuple[str, list[str], list[str] | None, int]] = [
    # The value-based family against its peers at their own settings, alternated in one process:
    # PQN on MinAtar Breakout against purejaxql's PQN, SAC against brax's SAC trainer.
    ("offpolicy-pqn-breakout-minatar-vs-purejaxql",
     ["bench/offpolicy.py", "--only", "Breakout-MinAtar", "--rounds", "6"], None, 150),
    ("offpolicy-sac-inverted-pendulum-vs-brax", ["bench/offpolicy.py", "--only", "sac", "--rounds", "6"], None, 120),
    # At 64 environments on a GPU, Jumanji's PPO-to-raw ratio says whether learning or the
    # environment bounds PPO once the arithmetic is cheap.
    ("envs-jumanji-64-envs",
     ["bench/envs.py", "--suites", "jumanji:PacMan-v1", "jumanji:Snake-v1", "--no-brax-trainer",
      "--no-recurrent"],
     ["bench/envs.py", "--suites", "CartPole-v1", "--steps", "4096", "--calls", "1", "--no-brax-trainer"], 120),
]

# brax's own PPO trainer at the brax row's sizes: 4,096 envs x 16 steps an update,
# 4 epochs of 16 minibatches of 4,096 transitions, 64x64 policy and value MLPs.
BRAX_PEER = """
import sys, time
import jax, jax.numpy as jnp
# brax 0.14's trainer still calls what JAX 0.11 removed; the same copies, spelled anew.
for name, copies in (("device_put_replicated", lambda x, devices: jax.tree.map(
                          lambda a: jnp.stack([jnp.asarray(a)] * len(devices)), x)),
                     ("device_put_sharded", lambda xs, devices: jax.tree.map(
                          lambda *a: jnp.stack(a), *xs))):
    try:
        getattr(jax, name)
    except AttributeError:
        setattr(jax, name, copies)
from brax import envs
from brax.training.agents.ppo import networks as ppo_networks
from brax.training.agents.ppo import train as ppo
env = envs.get_environment("ant", backend="spring")
steps, marks = int(sys.argv[1]), []
factory = lambda *a, **k: ppo_networks.make_ppo_networks(
    *a, **k, policy_hidden_layer_sizes=(64, 64), value_hidden_layer_sizes=(64, 64))
ppo.train(environment=env, num_timesteps=steps, num_envs=4096, batch_size=256, unroll_length=16,
          num_minibatches=16, num_updates_per_batch=4, episode_length=1000, num_evals=6,
          run_evals=False, network_factory=factory, seed=0,
          progress_fn=lambda step, metrics: marks.append((step, time.perf_counter())))
(s0, t0), (s1, t1) = marks[1], marks[-1]  # the first interval compiled the program
print("BRAX_SPS", (s1 - s0) / (t1 - t0))
"""


def steady_sps(metrics_path: str) -> float | None:
    """Env steps per second of training after the first logged interval."""
    try:
        rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    except OSError:
        return None
    timed = [r for r in rows if "wall_s" in r and "env_steps" in r]
    if len(timed) < 3:
        return None
    first, last = timed[0], timed[-1]
    seconds = last["wall_s"] - first["wall_s"]
    return (last["env_steps"] - first["env_steps"]) / seconds if seconds > 0 else None


def run_row(name: str, flags: list[str], limit: int, workdir: str) -> dict:
    run_dir = os.path.join(workdir, name)
    command = [sys.executable, LAUNCHER, *flags, *COMMON, f"--run-dir={run_dir}"]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = process.communicate(timeout=limit)
        status = "ok" if process.returncode == 0 else f"exit {process.returncode}: " + (
            stderr.strip().splitlines() or ["?"])[-1][:200]
    except subprocess.TimeoutExpired:
        # Stopped as a user stops a run (SIGTERM: it saves and writes its summary);
        # the intervals it logged still give its speed.
        process.terminate()
        try:
            process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
        status = f"stopped at its {limit} s limit"
    row = {"row": name, "flags": " ".join(flags), "status": status,
           "process_s": round(time.perf_counter() - start, 1)}
    try:
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
    except (OSError, ValueError):
        summary = {}
    row.update({key: summary.get(key) for key in ("sps", "compile_s", "episode_return_mean", "env_steps",
                                                  "devices")})
    row["steady_sps"] = steady_sps(os.path.join(run_dir, "metrics.jsonl"))
    return row


def run_script_row(name: str, argv: list[str], limit: int) -> dict:
    """A bench script run whole, its last line (its JSON result) kept."""
    row = {"row": name, "flags": " ".join(argv)}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=limit, cwd=REPO)
        lines = done.stdout.strip().splitlines()
        row["status"] = "ok" if done.returncode == 0 and lines else f"exit {done.returncode}: " + (
            done.stderr.strip().splitlines() or ["?"])[-1][:200]
        row["result"] = json.loads(lines[-1]) if row["status"] == "ok" else None
    except subprocess.TimeoutExpired:
        row.update(status=f"stopped at its {limit} s limit", result=None)
    row["process_s"] = round(time.perf_counter() - start, 1)
    return row


def brax_peer(limit: int, steps: int = 20_000_000) -> dict:
    row = {"row": "brax-own-ppo-ant-4k-envs", "flags": "brax.training.agents.ppo.train, same sizes"}
    try:
        done = subprocess.run([sys.executable, "-c", BRAX_PEER, str(steps)], capture_output=True,
                              text=True, timeout=limit)
        found = [line for line in done.stdout.splitlines() if line.startswith("BRAX_SPS")]
        row["status"] = "ok" if found else f"exit {done.returncode}: " + (
            done.stderr.strip().splitlines() or ["?"])[-1][:200]
        row["steady_sps"] = float(found[0].split()[1]) if found else None
    except subprocess.TimeoutExpired:
        row.update(status=f"over its {limit} s", steady_sps=None)
    return row


def device_name() -> str:
    import jax

    device = jax.devices()[0]
    return f"{len(jax.devices())} x {device.device_kind} ({device.platform}), jax {jax.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="tiny CartPole rows on any machine; suites skipped")
    parser.add_argument("--only", nargs="*", default=None, help="row names to run (default: all)")
    parser.add_argument("--out", default="accelerator.json", help="where the results file goes")
    parser.add_argument("--budget-s", type=float, default=540,
                        help="start no row after this many seconds; a row's limit never runs past it")
    args = parser.parse_args()
    started = time.perf_counter()
    results = {"device": device_name(), "dry": args.dry, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "rows": []}
    with tempfile.TemporaryDirectory(prefix="podracer-accelerator-") as workdir:
        # The launcher rows, then the bench scripts: each skipped where --dry or the budget says so.
        launch = functools.partial(run_row, workdir=workdir)
        every_row = [(*row, launch) for row in ROWS] + [(*row, run_script_row) for row in SCRIPT_ROWS]
        for name, flags, dry_flags, limit, run in every_row:
            if args.only is not None and name not in args.only:
                continue
            if args.dry and dry_flags is None:
                results["rows"].append({"row": name, "status": "not run in --dry"})
                continue
            left = args.budget_s - (time.perf_counter() - started)
            if left < 20:
                results["rows"].append({"row": name, "status": "not run: past --budget-s"})
                continue
            limit = int(min(180 if args.dry else limit, left))
            row = run(name, dry_flags if args.dry else flags, limit)
            results["rows"].append(row)
            measured = (json.dumps(row["result"]) if run is run_script_row
                        else f"sps {row['sps']}, steady {row['steady_sps']}")
            print(f"{name}: {row['status']}, {measured}", flush=True)
            left = args.budget_s - (time.perf_counter() - started)
            if name.startswith("anakin-ppo-brax") and not args.dry and left >= 20:
                results["rows"].append(brax_peer(int(min(limit, left))))
                print(f"brax's own PPO: {results['rows'][-1]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)

    def figure(value, digits=0):
        return "-" if value is None else f"{value:,.{digits}f}"

    table = [(r["row"], r["status"][:40], figure(r.get("sps")), figure(r.get("steady_sps")),
              figure(r.get("compile_s"), 1), figure(r.get("episode_return_mean"), 1)) for r in results["rows"]]
    common.report(f"podracer on {results['device']}", table,
                  ("row", "status", "sps", "steady_sps", "compile_s", "return"), results)


if __name__ == "__main__":
    main()
