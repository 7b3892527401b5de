"""Sebulba PPO and IMPALA throughput against their ceilings, on CartPole-v1 and Pong-v5.

Per environment and algorithm (`--algos`), with the (sebulba, algo, env)
preset, in this one process:

- sebulba: `podracer.sebulba.train_agent`, steady-state env steps/s
  (compilation and the first quarter of the run excluded).
- env ceiling: raw envpool, the same batches (environments per actor thread,
  envpool threads, recv batch size, one Python thread per actor thread),
  stepped with random actions and no policy.
- inference ceiling: the actors' compiled work alone, one Python thread per
  actor thread: the agent's `act` step on batches of the same shape
  (observations in, its packed output out, both copies included, its
  randomness drawn ahead as the actors draw it), and once per trajectory its
  `prepare` (PPO's and IMPALA's behaviour values).
- learner ceiling: the compiled learner step alone, on a fixed batch of the same
  shape on the same learner devices.
- efficiency = sps / min(env ceiling, learner ceiling): the bound where actors
  and learners have their own hardware (a TPU VM: host CPUs step, cores learn).
- serial_efficiency = sps / serial bound, the serial bound 1 / (1/env +
  1/inference + 1/learner): every env step costs an environment step, a share
  of a policy call and a share of an update, and where all three share the
  same cores (a laptop CPU) they cannot overlap; a pipeline that wastes
  nothing reads 1 (overlap on spare cores can push it above).
Each repeat's run is set against the ceilings measured just before it; the
repeat with the median serial efficiency is reported (on a shared machine the
load drifts between minutes).

Ends with one JSON line per environment and algorithm.

    python bench/sebulba_ppo.py [--envs CartPole-v1 Pong-v5] [--algos ppo impala] [--repeats 3]

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


def configs_for(env_id: str, algo: str, total_steps: int | None, overrides: list[str]):
    from podracer.orchestrate.cli import parse_configs

    steps = total_steps or RUN_STEPS.get(env_id, 200_000)
    return parse_configs(["--arch=sebulba", f"--algo={algo}", f"--env={env_id}", f"--total-steps={steps}",
                          *overrides])


def _layout(configs):
    import jax

    from podracer.algorithms import algorithm
    from podracer.sebulba.config import make_layout, split_devices

    sebulba = configs.sebulba
    split = split_devices(sebulba, jax.local_devices())
    return make_layout(sebulba, algorithm(configs)[1], split), split


def env_ceiling(configs, seconds: float) -> float:
    """Random-action envpool steps/s with the actors' batches, one Python thread per actor thread."""
    import envpool
    import numpy as np

    from podracer.sebulba.envs import is_atari

    run, sebulba = configs.run, configs.sebulba
    layout, _ = _layout(configs)
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

    return _threads_rate(step_envs, layout.num_actor_threads, counts, stop, seconds, warm_up_s=0.5)


def _threads_rate(work, num_threads: int, counts: list, stop: threading.Event, seconds: float,
                  warm_up_s: float) -> float:
    """Steps/s of `num_threads` threads running `work(index)`, each adding its steps to
    `counts[index]` until `stop`: counted over `seconds` after `warm_up_s`."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    time.sleep(warm_up_s)
    start_count, start = sum(counts), time.perf_counter()
    time.sleep(seconds)
    steps, elapsed = sum(counts) - start_count, time.perf_counter() - start
    stop.set()
    for thread in threads:
        thread.join()
    return steps / elapsed


def _agent(configs):
    """The run's agent on its network, with fresh state: (spec, agent, acting state)."""
    import jax
    import optax

    from podracer.algorithms import algorithm
    from podracer.sebulba.envs import env_spec

    algo, algo_config = algorithm(configs)
    spec = env_spec(configs.run.env)
    network = algo.make_network(spec, configs.network)
    agent = algo.make_agent(network, optax.sgd(0.0), algo_config, spec, configs.sebulba.rollout_len)
    return spec, agent, agent.acting_state(agent.init(jax.random.PRNGKey(0)))


def _observations(spec, shape, rng):
    import numpy as np

    if spec.obs_dtype == np.uint8:
        return rng.integers(0, 255, (*shape, *spec.obs_shape), dtype=np.uint8)
    return 0.1 * rng.normal(size=(*shape, *spec.obs_shape)).astype(np.float32)


def _trajectory(agent, acting_state, spec, num_steps: int, num_envs: int, rng):
    """A plausible trajectory of a fresh agent (its own actions and extras on random observations)."""
    import jax
    import numpy as np

    from podracer.agent import Trajectory

    flat = num_steps * num_envs
    obs = _observations(spec, (flat,), rng)
    randomness = jax.vmap(agent.draw)(jax.random.split(jax.random.PRNGKey(1), flat))
    carry = agent.initial_carry(flat)
    action, carry, extras = jax.jit(agent.act)(acting_state, obs, randomness, carry)
    rows = lambda tree: jax.tree.map(lambda x: np.asarray(x).reshape(num_steps, num_envs, *x.shape[1:]), tree)
    obs, action, extras, carry = rows((obs, action, extras, carry))
    shape = (num_steps, num_envs)
    return Trajectory(obs, action, np.ones(shape, np.float32), rng.random(shape) < 0.01, np.zeros(shape, bool),
                      obs, extras, carry, obs[-1], jax.tree.map(lambda x: x[-1], carry))


def inference_ceiling(configs, seconds: float) -> float:
    """Acting steps/s alone: the actors' compiled act step on observations of their batch's shape,
    and their `prepare` once per trajectory.

    One Python thread per actor thread, each on its actor device, each call
    copying the observations in and the packed output out, as an actor does.
    """
    import jax
    import numpy as np

    from podracer.sebulba.actor import Draws, make_acting

    sebulba = configs.sebulba
    layout, split = _layout(configs)
    spec, agent, acting_state = _agent(configs)
    acting = make_acting(agent, acting_state, spec)
    rng = np.random.default_rng(0)
    obs = _observations(spec, (layout.env_batch,), rng)
    carry = jax.tree.map(np.asarray, agent.initial_carry(layout.env_batch))
    trajectory = _trajectory(agent, acting_state, spec, sebulba.rollout_len, layout.envs_per_thread, rng)
    calls_per_trajectory = sebulba.rollout_len * layout.envs_per_thread // layout.env_batch
    counts = [0] * layout.num_actor_threads
    stop = threading.Event()

    def act(index: int) -> None:
        device = split.actor[index // sebulba.actor_threads]
        on_device = jax.device_put(acting_state, device)
        draws = Draws(acting, jax.device_put(jax.random.PRNGKey(index), device), sebulba.rollout_len,
                      layout.env_batch)
        jax.block_until_ready(acting.prepare(on_device, trajectory))  # compiled before the count starts
        while not stop.is_set():
            for _ in range(calls_per_trajectory):
                packed = acting.step(on_device, jax.device_put(obs, device), draws.next(), carry)
                acting.unpack(np.asarray(packed))
                counts[index] += layout.env_batch
            jax.block_until_ready(acting.prepare(on_device, trajectory))

    return _threads_rate(act, layout.num_actor_threads, counts, stop, seconds, warm_up_s=1.0)  # compile, warm up


def serial_bound(*ceilings: float) -> float:
    """Steps/s when each step pays every stage in turn: 1 / sum(1 / ceiling)."""
    return 1.0 / sum(1.0 / c for c in ceilings)


def learner_ceiling(configs, seconds: float) -> float:
    """Learner steps/s alone: the compiled learner step on a fixed, prepared batch of the run's shape."""
    import jax
    import numpy as np

    from podracer.protocol import parallel
    from podracer.sebulba.train import build

    setup = build(configs)
    agent, envs = setup.agent, setup.layout.envs_per_thread
    acting_state = agent.acting_state(parallel.local_replica(setup.state))
    # A fresh agent's own actions and behaviour values: the update's numerics, hence
    # its speed, match a real batch.
    trajectory = _trajectory(agent, acting_state, setup.spec, configs.sebulba.rollout_len, envs,
                             np.random.default_rng(0))
    batch, bootstrap = jax.jit(agent.prepare)(acting_state, trajectory)
    batch = parallel.from_host(batch, parallel.time_major_sharded(setup.mesh))
    bootstrap, carry = parallel.from_host((bootstrap, jax.tree.map(np.asarray, agent.initial_carry(envs))),
                                          parallel.sharded(setup.mesh))
    threads = setup.layout.num_actor_threads
    inputs = ((batch,) * threads, (bootstrap,) * threads, jax.random.PRNGKey(0), (carry,) * threads)
    state, _ = setup.step_fn(setup.state, *inputs)
    jax.block_until_ready(state)
    updates, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or updates < 2:
        state, metrics = setup.step_fn(state, *inputs)
        jax.device_get(metrics)
        updates += 1
    return updates * setup.layout.steps_per_update / (time.perf_counter() - start)


def sebulba_run(configs) -> dict:
    """Train; steady-state steps/s from metrics.jsonl, skipping the first quarter of the run."""
    import dataclasses

    from podracer.sebulba.train import train_agent

    with tempfile.TemporaryDirectory() as run_dir:
        run = dataclasses.replace(configs.run, run_dir=run_dir)
        summary, _ = train_agent(configs.replace(run=run))
        rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    first, last = rows[len(rows) // 4], rows[-1]
    if last["wall_s"] > first["wall_s"]:
        steady = (last["env_steps"] - first["env_steps"]) / (last["wall_s"] - first["wall_s"])
    else:
        steady = summary["sps"]
    returns = [r["episode_return_mean"] for r in rows if r["episode_return_mean"] is not None]
    return {"sps": steady, "run_sps": summary["sps"], "summary": summary,
            "first_return": returns[0] if returns else None, "last_return": returns[-1] if returns else None}


def measure(configs, args) -> dict:
    """One (environment, algorithm) row: the ceilings and a run, `args.repeats` times; the median repeat."""
    env_sps, inference_sps, learner_sps, runs = [], [], [], []
    for _ in range(args.repeats):
        env_sps.append(env_ceiling(configs, args.seconds))
        inference_sps.append(inference_ceiling(configs, args.seconds))
        learner_sps.append(learner_ceiling(configs, args.seconds))
        runs.append(sebulba_run(configs))
    # Each repeat pairs a run with ceilings measured just before it, under the
    # same machine load; the median repeat is reported.
    efficiencies = [run["sps"] / min(e, l) for run, e, l in zip(runs, env_sps, learner_sps)]
    bounds = [serial_bound(*c) for c in zip(env_sps, inference_sps, learner_sps)]
    serial = [run["sps"] / bound for run, bound in zip(runs, bounds)]
    median = sorted(range(len(runs)), key=lambda i: serial[i])[len(runs) // 2]
    chosen, summary = runs[median], runs[median]["summary"]
    run, sebulba = configs.run, configs.sebulba
    return {
        "bench": "sebulba_ppo", "env": run.env, "algo": run.algo, "sps": chosen["sps"],
        "run_sps": chosen["run_sps"], "env_ceiling_sps": env_sps[median],
        "inference_ceiling_sps": inference_sps[median], "learner_ceiling_sps": learner_sps[median],
        "serial_bound_sps": bounds[median],
        "efficiency": efficiencies[median], "efficiency_per_repeat": efficiencies,
        "serial_efficiency": serial[median], "serial_efficiency_per_repeat": serial,
        "num_envs": sebulba.num_envs, "rollout_len": sebulba.rollout_len,
        "actor_threads": summary["actor_threads"], "env_threads": sebulba.env_threads,
        "async_envs": sebulba.async_envs, "learner_devices": summary["learner_devices"],
        "policy_lag_mean": summary["policy_lag_mean"], "async_dispatch": args.async_dispatch,
        "first_return": chosen["first_return"], "last_return": chosen["last_return"],
        **{k: v for k, v in summary.items() if k.startswith("time_")},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=["CartPole-v1", "Pong-v5"])
    parser.add_argument("--algos", nargs="+", default=["ppo", "impala"], choices=["ppo", "impala"])
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
        for algo in args.algos:
            results.append(measure(configs_for(env_id, algo, args.total_steps, overrides), args))
    fmt = lambda v: f"{v:,.0f}" if isinstance(v, float) and abs(v) >= 100 else \
        f"{v:.2f}" if isinstance(v, float) else str(v)
    header = ("env", "algo", "sebulba steps/s", "env ceiling", "inference ceiling", "learner ceiling",
              "serial bound", "efficiency (min)", "serial efficiency", "return first->last")
    rows = [(r["env"], r["algo"], fmt(r["sps"]), fmt(r["env_ceiling_sps"]), fmt(r["inference_ceiling_sps"]),
             fmt(r["learner_ceiling_sps"]), fmt(r["serial_bound_sps"]), fmt(r["efficiency"]),
             fmt(r["serial_efficiency"]), f"{fmt(r['first_return'])} -> {fmt(r['last_return'])}")
            for r in results]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    print(f"Sebulba PPO and IMPALA vs their ceilings  ({common.machine()})")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
