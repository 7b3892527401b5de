"""A population of 16 Anakin PPO agents against the single-file JAX PPO's own 16-seed vmap.

CartPole-v1 with the reference hyperparameters of `bench/anakin_ppo.py` (4 envs
x 128 steps, 4 epochs x 4 minibatches, 64x64 tanh MLPs, Adam 2.5e-4 annealed),
500k steps for each agent, everything measured in this one process:

- podracer: `--num-seeds=16` through the launcher's own builder
  (`podracer.anakin.train.build`): one compiled program, agents vmapped. On
  the devices the launcher gives this run by default
  (`podracer.orchestrate.cli.default_cpu_devices`: on a CPU, one device per
  core, each running its share of the agents), which is the headline `sps`;
  and on one device, as the peer runs.
- peer: `bench/peer_purejaxrl.py`'s `make_train`, vmapped over 16 keys and
  jitted, as the single-file PPO trains its seeds.
- compile only: podracer's program for one agent and for the 16 (on the
  launcher's default devices), each traced, lowered and compiled first in a
  new process (median of `--compile-rounds`, alternating), for the
  compile-time target (a population compiles in no more than one agent's time
  plus 10%); the peer's one-seed and 16-seed programs the same way, for what
  vmapping the seeds costs it. The run rows' compile column is measured inside
  this process, after other compilations.

`sps` is aggregate env steps/s (all agents) over a whole run, first call
included; `time_to_all_solved_s` is compile time plus training time until every
agent has had an interval (an eighth of the run) of mean return >= 475;
`busy cores` is the process's CPU seconds over the training's wall seconds. A
256-agent point shows how it scales (two calls of 16 updates per agent, on the
default devices).

    python bench/population.py [--repeats 1]
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

from podracer.anakin import train as anakin_train
from podracer.orchestrate.cli import default_cpu_devices, usable_cores
from podracer.orchestrate.parse import parse

SEEDS, NUM_ENVS, ROLLOUT, TOTAL, SOLVED, CALLS = 16, 4, 128, 500_000, 475.0, 8
UPDATES_PER_CALL = TOTAL // (NUM_ENVS * ROLLOUT) // CALLS  # 122
REFERENCE = [f"--num-envs={NUM_ENVS}", f"--rollout-len={ROLLOUT}", "--epochs=4", "--minibatches=4",
             "--hidden", "64", "64", "--lr=2.5e-4", f"--total-steps={TOTAL}",
             f"--updates-per-call={UPDATES_PER_CALL}"]


def reference_configs(num_seeds: int, extra=()):
    return parse(REFERENCE + ([f"--num-seeds={num_seeds}"] if num_seeds > 1 else []) + list(extra)).configs


def launcher_devices(num_seeds: int) -> int:
    """The CPU devices `python launch/tpu.py` gives this run on this machine without --cpu-devices."""
    return default_cpu_devices(reference_configs(num_seeds), usable_cores())


def ours(num_seeds: int, devices, calls: int = CALLS, extra=()) -> dict:
    configs = reference_configs(num_seeds, extra)
    built = anakin_train.build(configs, devices)
    runner = built.init(None)
    start = time.perf_counter()
    step = built.step.lower(runner).compile()
    compile_s = time.perf_counter() - start
    steps_per_call = built.calls.steps_per_call * num_seeds
    solved_at = [None] * num_seeds
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(calls):
        runner, metrics = step(runner)
        m = jax.device_get(metrics)
        returns = m["episode_return_sum"].sum(0) / np.maximum(1, m["episodes"].sum(0))  # [U, A] -> [A]
        now = time.perf_counter() - start
        solved_at = [s if s is not None or r < SOLVED else now for s, r in zip(solved_at, returns)]
    train_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    solved = None if None in solved_at else compile_s + max(solved_at)
    return {"sps": calls * steps_per_call / train_s, "compile_s": compile_s, "train_s": train_s,
            "busy_cores": cpu_s / train_s,
            "time_to_all_solved_s": solved, "solved": sum(s is not None for s in solved_at)}


def peer(num_seeds: int) -> dict:
    import peer_purejaxrl  # imports gymnax, which starts JAX's backend: after the device split

    train = jax.jit(jax.vmap(peer_purejaxrl.make_train(peer_purejaxrl.REFERENCE_CONFIG)))
    keys = jax.random.split(jax.random.PRNGKey(0), num_seeds)
    start = time.perf_counter()
    compiled = train.lower(keys).compile()
    compile_s = time.perf_counter() - start
    cpu_start = time.process_time()
    out, train_s = common.timed(compiled, keys)
    cpu_s = time.process_time() - cpu_start
    returns = np.asarray(out["returns"]).reshape(num_seeds, -1)
    steps = returns.size * NUM_ENVS * ROLLOUT
    # Same criterion as ours: an eighth of the run with mean return >= 475, for every seed.
    chunks = np.stack([[np.nanmean(c) for c in np.array_split(r, CALLS)] for r in returns])
    first = [next((i for i, c in enumerate(row) if c >= SOLVED), None) for row in chunks]
    solved = None if None in first else compile_s + train_s * (max(first) + 1) / CALLS
    return {"sps": steps / train_s, "compile_s": compile_s, "train_s": train_s, "busy_cores": cpu_s / train_s,
            "time_to_all_solved_s": solved, "solved": sum(f is not None for f in first)}


def compile_s(num_seeds: int) -> float:
    """Seconds to trace, lower and compile the training program of `num_seeds` agents (1: one agent),
    on every device of the process (the launcher's default for it)."""
    built = anakin_train.build(reference_configs(num_seeds), jax.devices())
    runner = built.init(None if num_seeds > 1 else jax.random.PRNGKey(0))
    start = time.perf_counter()
    built.step.lower(runner).compile()
    return time.perf_counter() - start


def peer_compile_s(num_seeds: int) -> float:
    """Seconds to trace, lower and compile the peer's training program: jitted as it is for
    one seed, its `jax.vmap` over the seeds' keys otherwise, as the single-file PPO does."""
    import peer_purejaxrl

    train = peer_purejaxrl.make_train(peer_purejaxrl.REFERENCE_CONFIG)
    key = jax.random.PRNGKey(0)
    train, keys = (jax.jit(train), key) if num_seeds == 1 else (
        jax.jit(jax.vmap(train)), jax.random.split(key, num_seeds))
    jax.jit(lambda k: k + 1)(key).block_until_ready()  # the process's first compilation, as ours has init's
    start = time.perf_counter()
    train.lower(keys).compile()
    return time.perf_counter() - start


def fresh_compile_s(num_seeds: int, of_peer: bool = False) -> float:
    """`compile_s` (or `peer_compile_s`) in a new process: a process's first compilation pays
    one-time costs (0.4-0.6 s here) and later ones reuse what earlier ones built, so the
    one-agent and population programs are each compiled first in a process of their own."""
    flags = [f"--compile-only={num_seeds}"] + (["--peer"] if of_peer else [])
    out = subprocess.run([sys.executable, __file__, *flags], check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])["compile_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="alternating whole runs of each")
    parser.add_argument("--agents-256", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure two calls of 256 agents")
    parser.add_argument("--compile-rounds", type=int, default=3,
                        help="alternating fresh-process compilations of one agent and of the population")
    parser.add_argument("--compile-only", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # The launcher's device split, made as it makes it: before JAX's backend starts.
    split = 1 if args.peer else launcher_devices(args.compile_only or SEEDS)
    if split > 1:
        jax.config.update("jax_num_cpu_devices", split)
    if args.compile_only:  # a child of fresh_compile_s
        of = peer_compile_s if args.peer else compile_s
        print(json.dumps({"compile_s": of(args.compile_only)}))
        return
    # The peer's own one-seed and 16-seed programs too: what vmapping the seeds costs it.
    fresh = {(n, of_peer): [] for of_peer in (False, True) for n in (1, SEEDS)}
    for _ in range(args.compile_rounds):
        for n, of_peer in fresh:
            fresh[n, of_peer].append(fresh_compile_s(n, of_peer))
    single_compile, population_compile, peer_single_compile, peer_population_compile = (
        statistics.median(fresh[key]) for key in ((1, False), (SEEDS, False), (1, True), (SEEDS, True)))
    runs = {"default": [], "one": [], "peer": []}
    for _ in range(args.repeats):  # alternate so all see the same machine noise
        runs["default"].append(ours(SEEDS, jax.devices()))
        runs["peer"].append(peer(SEEDS))
        if split > 1:
            runs["one"].append(ours(SEEDS, jax.devices()[:1]))
    best = {name: max(r, key=lambda x: x["sps"]) for name, r in runs.items() if r}
    big = ours(256, jax.devices(), calls=2, extra=["--updates-per-call=16"]) if args.agents_256 else None
    fmt = lambda v: "-" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v)
    row = lambda name, r: (name, fmt(r["sps"]), f"{r['busy_cores']:.2f}", fmt(r["compile_s"]),
                           fmt(r["time_to_all_solved_s"]), f"{r['solved']}/{SEEDS if '256' not in name else 256}")
    devices = lambda n: f"{n} device{'s' if n > 1 else ''}"
    o, p = best["default"], best["peer"]
    one = best.get("one", o)
    rows = [row(f"podracer --num-seeds=16, {devices(split)} (the launcher's default here)", o)]
    if split > 1:
        rows.append(row("podracer --num-seeds=16, 1 device (as the peer)", one))
    rows.append(row("peer single-file PPO, vmap of 16 seeds, 1 device", p))
    if big:
        rows.append(row(f"podracer 256 agents, {devices(split)} (2 calls of 16 updates)", big))
    rows.append(("podracer 16 agents: compile only, new process", "-", "-", fmt(population_compile), "-", "-"))
    rows.append(("podracer one agent: compile only, new process", "-", "-", fmt(single_compile), "-", "-"))
    rows.append(("peer 16 seeds: compile only, new process", "-", "-", fmt(peer_population_compile), "-", "-"))
    rows.append(("peer one seed: compile only, new process", "-", "-", fmt(peer_single_compile), "-", "-"))
    result = {"bench": "population", "env": "CartPole-v1", "seeds": SEEDS, "devices": split,
              "sps": o["sps"], "peer_sps": p["sps"], "ratio_to_peer": o["sps"] / p["sps"],
              "sps_one_device": one["sps"], "ratio_one_device_to_peer": one["sps"] / p["sps"],
              "busy_cores": o["busy_cores"], "busy_cores_one_device": one["busy_cores"],
              "peer_busy_cores": p["busy_cores"],
              "compile_s": o["compile_s"], "peer_compile_s": p["compile_s"],
              "fresh_compile_s": population_compile, "one_seed_compile_s": single_compile,
              "compile_ratio_to_one_seed": population_compile / single_compile,
              "peer_fresh_compile_s": peer_population_compile, "peer_one_seed_compile_s": peer_single_compile,
              "peer_compile_ratio_to_one_seed": peer_population_compile / peer_single_compile,
              "time_to_all_solved_s": o["time_to_all_solved_s"],
              "peer_time_to_all_solved_s": p["time_to_all_solved_s"],
              "solved": o["solved"], "peer_solved": p["solved"],
              "sps_256_agents": big["sps"] if big else None,
              "compile_s_256_agents": big["compile_s"] if big else None}
    common.report("Populations: 16 Anakin PPO agents vs the single-file PPO's 16-seed vmap, CartPole-v1, "
                  "4 envs x 128 steps, 500k steps each", rows,
                  ("run", "aggregate steps/s", "busy cores", "compile s", "all solved s", "solved"), result)


if __name__ == "__main__":
    main()
