"""Sebulba PPO throughput against its two ceilings, on CartPole-v1 and Pong-v5.

Per environment, with the (sebulba, ppo, env) preset, in this one process:

- sebulba: `podracer.sebulba.train_ppo`, steady-state env steps/s (compilation
  and the first quarter of the run excluded).
- env ceiling: raw envpool, the same batches (environments per actor thread,
  envpool threads, recv batch size, one Python thread per actor thread),
  stepped with random actions and no policy.
- learner ceiling: the compiled learner step alone, on a fixed batch of the same
  shape on the same learner devices.
- efficiency = sps / min(env ceiling, learner ceiling), each repeat's run against
  the ceilings measured just before it; the repeat with the median efficiency
  is reported (on a shared machine the load drifts between minutes).

Ends with one JSON line per environment.

    python bench/sebulba_ppo.py [--envs CartPole-v1 Pong-v5] [--repeats 3] [--cpu-devices 2]

CPU work runs inline, as the launcher runs Sebulba (`--async-dispatch` to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import warnings

import common  # noqa: F401  (puts the repository on sys.path)

# Steps per Sebulba run: long enough for a steady state, short enough to repeat.
RUN_STEPS = {"CartPole-v1": 2_000_000, "Pong-v5": 24 * 128 * 6}


def configs_for(env_id: str, total_steps: int | None, overrides: list[str]) -> dict:
    from podracer.orchestrate.cli import parse_configs

    steps = total_steps or RUN_STEPS.get(env_id, 200_000)
    return parse_configs(["--arch=sebulba", "--algo=ppo", f"--env={env_id}", f"--total-steps={steps}",
                          *overrides])


def env_ceiling(configs: dict, seconds: float) -> float:
    """Random-action envpool steps/s with the actors' batches, one Python thread per actor thread."""
    import envpool
    import numpy as np

    from podracer.sebulba.config import make_layout, split_devices
    from podracer.sebulba.envs import is_atari
    import jax

    run, sebulba = configs["run"], configs["sebulba"]
    layout = make_layout(sebulba, configs["ppo"], split_devices(sebulba, jax.local_devices()))
    options = dict(episodic_life=True, reward_clip=True) if is_atari(run.env) else {}
    counts = [0] * layout.num_actor_threads
    stop = threading.Event()

    def step_envs(index: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pool = envpool.make(run.env, env_type="gymnasium", num_envs=layout.envs_per_thread,
                                batch_size=layout.env_batch, num_threads=sebulba.env_threads,
                                seed=index, **options)
        space = pool.action_space
        rng = np.random.default_rng(index)
        actions = [np.stack([space.sample() for _ in range(layout.env_batch)]) for _ in range(64)]
        rng.shuffle(actions)
        pool.async_reset()
        i = 0
        while not stop.is_set():
            _, _, _, _, info = pool.recv()
            pool.send(actions[i % 64], info["env_id"])
            counts[index] += layout.env_batch
            i += 1
        pool.close()

    threads = [threading.Thread(target=step_envs, args=(i,)) for i in range(layout.num_actor_threads)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # warm up
    start_count, start = sum(counts), time.perf_counter()
    time.sleep(seconds)
    steps, elapsed = sum(counts) - start_count, time.perf_counter() - start
    stop.set()
    for thread in threads:
        thread.join()
    return steps / elapsed


def learner_ceiling(configs: dict, seconds: float) -> float:
    """Learner steps/s alone: the compiled update on a fixed batch of the run's shape."""
    import jax
    import numpy as np

    from podracer.protocol import parallel
    from podracer.sebulba.train import _column_shapes, build

    setup = build(configs)
    rng = np.random.default_rng(0)
    column = _column_shapes(setup.spec, configs["sebulba"].rollout_len)
    envs, spec = setup.layout.envs_per_thread, setup.spec
    shape = (column.reward.shape[0], envs)
    # Plausible values (behaviour log-probabilities of a fresh policy, small
    # observations): the update's numerics, hence its speed, match a real batch.
    fixed = column._replace(
        obs=(rng.integers(0, 255, (*shape, *spec.obs_shape), dtype=np.uint8) if spec.obs_dtype == np.uint8
             else 0.1 * rng.normal(size=(*shape, *spec.obs_shape)).astype(np.float32)),
        action=(rng.integers(0, spec.action_dim, shape, dtype=np.int32) if spec.discrete
                else rng.normal(size=(*shape, spec.action_dim)).astype(np.float32)),
        reward=np.ones(shape, np.float32),
        terminated=rng.random(shape) < 0.01,
        truncated=np.zeros(shape, bool),
        value=np.zeros(shape, np.float32),
        log_prob=np.full(shape, -np.log(spec.action_dim) if spec.discrete else -1.42 * spec.action_dim,
                         np.float32),
        final_value=np.zeros(shape, np.float32))

    batch = jax.device_put(fixed, parallel.time_major_sharded(setup.mesh))
    bootstrap = jax.device_put(np.zeros(envs, np.float32), parallel.sharded(setup.mesh))
    threads = setup.layout.num_actor_threads
    state, key = setup.state, jax.random.PRNGKey(0)
    state, _ = setup.step_fn(state, (batch,) * threads, (bootstrap,) * threads, key)
    jax.block_until_ready(state)
    updates, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or updates < 2:
        state, metrics = setup.step_fn(state, (batch,) * threads, (bootstrap,) * threads, key)
        jax.device_get(metrics)
        updates += 1
    return updates * setup.layout.steps_per_update / (time.perf_counter() - start)


def sebulba_run(configs: dict) -> dict:
    """Train; steady-state steps/s from metrics.jsonl, skipping the first quarter of the run."""
    import dataclasses

    from podracer.sebulba.train import train_ppo

    with tempfile.TemporaryDirectory() as run_dir:
        run = dataclasses.replace(configs["run"], run_dir=run_dir)
        summary, _ = train_ppo({**configs, "run": run})
        rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    first, last = rows[len(rows) // 4], rows[-1]
    if last["wall_s"] > first["wall_s"]:
        steady = (last["env_steps"] - first["env_steps"]) / (last["wall_s"] - first["wall_s"])
    else:
        steady = summary["sps"]
    returns = [r["episode_return_mean"] for r in rows if r["episode_return_mean"] is not None]
    return {"sps": steady, "run_sps": summary["sps"], "summary": summary,
            "first_return": returns[0] if returns else None, "last_return": returns[-1] if returns else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=["CartPole-v1", "Pong-v5"])
    parser.add_argument("--repeats", type=int, default=3, help="repeats of ceilings and run; the median is kept")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each ceiling measurement")
    parser.add_argument("--total-steps", type=int, default=None, help="steps per Sebulba run")
    parser.add_argument("--cpu-devices", type=int, default=0, help="split the CPU into this many devices")
    parser.add_argument("--async-dispatch", action="store_true",
                        help="keep JAX's asynchronous CPU dispatch (the launcher turns it off for Sebulba)")
    parser.add_argument("flags", nargs=argparse.REMAINDER,
                        help="after --, flags for launch/tpu.py (e.g. -- --num-envs=64)")
    args = parser.parse_args()

    from podracer.config import RunConfig
    from podracer.orchestrate.cli import process_wide_jax_settings

    if args.async_dispatch:  # keep XLA's asynchronous CPU dispatch: only the device count
        process_wide_jax_settings(RunConfig(cpu_devices=args.cpu_devices))
    else:
        process_wide_jax_settings(RunConfig(arch="sebulba", cpu_devices=args.cpu_devices))
    overrides = [flag for flag in args.flags if flag != "--"]
    results = []
    for env_id in args.envs:
        configs = configs_for(env_id, args.total_steps, overrides)
        env_sps, learner_sps, runs = [], [], []
        for _ in range(args.repeats):
            env_sps.append(env_ceiling(configs, args.seconds))
            learner_sps.append(learner_ceiling(configs, args.seconds))
            runs.append(sebulba_run(configs))
        # Each repeat pairs a run with ceilings measured just before it, under the
        # same machine load; the median repeat is reported.
        efficiencies = [run["sps"] / min(e, l) for run, e, l in zip(runs, env_sps, learner_sps)]
        median = sorted(range(len(runs)), key=lambda i: efficiencies[i])[len(runs) // 2]
        chosen, summary = runs[median], runs[median]["summary"]
        sebulba = configs["sebulba"]
        results.append({
            "bench": "sebulba_ppo", "env": env_id, "sps": chosen["sps"], "run_sps": chosen["run_sps"],
            "env_ceiling_sps": env_sps[median], "learner_ceiling_sps": learner_sps[median],
            "efficiency": efficiencies[median], "efficiency_per_repeat": efficiencies,
            "num_envs": sebulba.num_envs, "rollout_len": sebulba.rollout_len,
            "actor_threads": summary["actor_threads"], "env_threads": sebulba.env_threads,
            "async_envs": sebulba.async_envs, "learner_devices": summary["learner_devices"],
            "policy_lag_mean": summary["policy_lag_mean"], "async_dispatch": args.async_dispatch,
            "first_return": chosen["first_return"], "last_return": chosen["last_return"],
            **{k: v for k, v in summary.items() if k.startswith("time_")},
        })
    fmt = lambda v: f"{v:,.0f}" if isinstance(v, float) and abs(v) >= 100 else \
        f"{v:.2f}" if isinstance(v, float) else str(v)
    header = ("env", "sebulba steps/s", "env ceiling", "learner ceiling", "efficiency", "return first->last")
    rows = [(r["env"], fmt(r["sps"]), fmt(r["env_ceiling_sps"]), fmt(r["learner_ceiling_sps"]),
             fmt(r["efficiency"]), f"{fmt(r['first_return'])} -> {fmt(r['last_return'])}") for r in results]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    print(f"Sebulba PPO vs its ceilings  ({common.machine()})")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
