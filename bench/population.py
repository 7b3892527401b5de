"""A population of 16 Anakin PPO agents against the single-file JAX PPO's own 16-seed vmap.

CartPole-v1 with the reference hyperparameters of `bench/anakin_ppo.py` (4 envs
x 128 steps, 4 epochs x 4 minibatches, 64x64 tanh MLPs, Adam 2.5e-4 annealed),
500k steps for each agent, everything measured in this one process:

- podracer: `--num-seeds=16` through the launcher's own builder
  (`podracer.anakin.train.build`): one compiled program, agents vmapped, on
  one device (as the peer) and, where there are several, split over them.
- peer: `bench/peer_purejaxrl.py`'s `make_train`, vmapped over 16 keys and
  jitted, as the single-file PPO trains its seeds.
- compile only: podracer's program for one agent and for the 16, each
  traced, lowered and compiled first in a new process (median of
  `--compile-rounds`, alternating), for the compile-time target (a population
  compiles in no more than one agent's time plus 10%). The run rows' compile
  column is measured inside this process, after other compilations.

`sps` is aggregate env steps/s (all agents) over a whole run, first call
included; `time_to_all_solved_s` is compile time plus training time until every
agent has had an interval (an eighth of the run) of mean return >= 475. A
256-agent point shows how it scales (one call of 16 updates per agent).

    python bench/population.py [--repeats 1] [--devices 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import common  # noqa: F401  (puts the repository on sys.path)
import jax
import numpy as np

import peer_purejaxrl
from podracer.anakin import train as anakin_train
from podracer.orchestrate.parse import parse

SEEDS, NUM_ENVS, ROLLOUT, TOTAL, SOLVED, CALLS = 16, 4, 128, 500_000, 475.0, 8
UPDATES_PER_CALL = TOTAL // (NUM_ENVS * ROLLOUT) // CALLS  # 122
REFERENCE = [f"--num-envs={NUM_ENVS}", f"--rollout-len={ROLLOUT}", "--epochs=4", "--minibatches=4",
             "--hidden", "64", "64", "--lr=2.5e-4", f"--total-steps={TOTAL}",
             f"--updates-per-call={UPDATES_PER_CALL}"]


def ours(num_seeds: int, devices, calls: int = CALLS, extra=()) -> dict:
    configs = parse(REFERENCE + [f"--num-seeds={num_seeds}", *extra]).configs
    built = anakin_train.build(configs, devices)
    runner = built.init(None)
    start = time.perf_counter()
    step = built.step.lower(runner).compile()
    compile_s = time.perf_counter() - start
    steps_per_call = built.calls.steps_per_call * num_seeds
    solved_at = [None] * num_seeds
    start = time.perf_counter()
    for _ in range(calls):
        runner, metrics = step(runner)
        m = jax.device_get(metrics)
        returns = m["episode_return_sum"].reshape(num_seeds, -1).sum(1) / np.maximum(
            1, m["episodes"].reshape(num_seeds, -1).sum(1))
        now = time.perf_counter() - start
        solved_at = [s if s is not None or r < SOLVED else now for s, r in zip(solved_at, returns)]
    train_s = time.perf_counter() - start
    solved = None if None in solved_at else compile_s + max(solved_at)
    return {"sps": calls * steps_per_call / train_s, "compile_s": compile_s, "train_s": train_s,
            "time_to_all_solved_s": solved, "solved": sum(s is not None for s in solved_at)}


def peer(num_seeds: int) -> dict:
    train = jax.jit(jax.vmap(peer_purejaxrl.make_train(peer_purejaxrl.REFERENCE_CONFIG)))
    keys = jax.random.split(jax.random.PRNGKey(0), num_seeds)
    start = time.perf_counter()
    compiled = train.lower(keys).compile()
    compile_s = time.perf_counter() - start
    out, train_s = common.timed(compiled, keys)
    returns = np.asarray(out["returns"]).reshape(num_seeds, -1)
    steps = returns.size * NUM_ENVS * ROLLOUT
    # Same criterion as ours: an eighth of the run with mean return >= 475, for every seed.
    chunks = np.stack([[np.nanmean(c) for c in np.array_split(r, CALLS)] for r in returns])
    first = [next((i for i, c in enumerate(row) if c >= SOLVED), None) for row in chunks]
    solved = None if None in first else compile_s + train_s * (max(first) + 1) / CALLS
    return {"sps": steps / train_s, "compile_s": compile_s, "train_s": train_s,
            "time_to_all_solved_s": solved, "solved": sum(f is not None for f in first)}


def compile_s(num_seeds: int) -> float:
    """Seconds to trace, lower and compile the training program of `num_seeds` agents (1: one agent)."""
    configs = parse(REFERENCE + ([f"--num-seeds={num_seeds}"] if num_seeds > 1 else [])).configs
    built = anakin_train.build(configs, jax.devices()[:1])
    runner = built.init(None if num_seeds > 1 else jax.random.PRNGKey(0))
    start = time.perf_counter()
    built.step.lower(runner).compile()
    return time.perf_counter() - start


def fresh_compile_s(num_seeds: int) -> float:
    """`compile_s` in a new process: a process's first compilation pays one-time costs
    (0.4-0.6 s here) and later ones reuse what earlier ones built, so the one-agent
    and population programs are each compiled first in a process of their own."""
    out = subprocess.run([sys.executable, __file__, f"--compile-only={num_seeds}"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])["compile_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="alternating whole runs of each")
    parser.add_argument("--agents-256", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure one call of 256 agents")
    parser.add_argument("--compile-rounds", type=int, default=3,
                        help="alternating fresh-process compilations of one agent and of the population")
    parser.add_argument("--compile-only", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_only:  # a child of fresh_compile_s
        print(json.dumps({"compile_s": compile_s(args.compile_only)}))
        return
    one = jax.devices()[:1]
    fresh = {1: [], SEEDS: []}
    for _ in range(args.compile_rounds):
        for n in fresh:
            fresh[n].append(fresh_compile_s(n))
    single_compile, population_compile = (statistics.median(fresh[n]) for n in (1, SEEDS))
    runs = {"ours": [], "peer": [], "ours_all": []}
    for _ in range(args.repeats):  # alternate so both see the same machine noise
        runs["ours"].append(ours(SEEDS, one))
        runs["peer"].append(peer(SEEDS))
        if len(jax.devices()) > 1:
            runs["ours_all"].append(ours(SEEDS, jax.devices()))
    best = {name: max(r, key=lambda x: x["sps"]) for name, r in runs.items() if r}
    big = ours(256, one, calls=2, extra=["--updates-per-call=16"]) if args.agents_256 else None
    fmt = lambda v: "-" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v)
    row = lambda name, r: (name, fmt(r["sps"]), fmt(r["compile_s"]), fmt(r["time_to_all_solved_s"]),
                           f"{r['solved']}/{SEEDS if '256' not in name else 256}")
    rows = [row("podracer --num-seeds=16, 1 device", best["ours"]),
            row("peer single-file PPO, vmap of 16 seeds", best["peer"])]
    if "ours_all" in best:
        rows.append(row(f"podracer --num-seeds=16, {len(jax.devices())} devices (agents split)",
                        best["ours_all"]))
    if big:
        rows.append(row("podracer 256 agents, 1 device (2 calls of 16 updates)", big))
    rows.append(("podracer 16 agents: compile only, new process", "-", fmt(population_compile), "-", "-"))
    rows.append(("podracer one agent: compile only, new process", "-", fmt(single_compile), "-", "-"))
    o, p = best["ours"], best["peer"]
    result = {"bench": "population", "env": "CartPole-v1", "seeds": SEEDS,
              "sps": o["sps"], "peer_sps": p["sps"], "ratio_to_peer": o["sps"] / p["sps"],
              "compile_s": o["compile_s"], "peer_compile_s": p["compile_s"],
              "fresh_compile_s": population_compile, "one_seed_compile_s": single_compile,
              "compile_ratio_to_one_seed": population_compile / single_compile,
              "time_to_all_solved_s": o["time_to_all_solved_s"],
              "peer_time_to_all_solved_s": p["time_to_all_solved_s"],
              "solved": o["solved"], "peer_solved": p["solved"],
              "sps_all_devices": best["ours_all"]["sps"] if "ours_all" in best else None,
              "sps_256_agents": big["sps"] if big else None,
              "compile_s_256_agents": big["compile_s"] if big else None}
    common.report("Populations: 16 Anakin PPO agents vs the single-file PPO's 16-seed vmap, CartPole-v1, "
                  "4 envs x 128 steps, 500k steps each", rows,
                  ("run", "aggregate steps/s", "compile s", "all solved s", "solved"), result)


if __name__ == "__main__":
    main()
