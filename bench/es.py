#!/usr/bin/env python
"""Anakin ES throughput next to evosax's OpenAI-ES and the raw environment ceiling.

All three run in this one process, on the same gymnax environment, batch and
horizon, timed in interleaved rounds so that a busy machine slows them alike,
each figure the fastest of its rounds (contention only ever adds time):

- env ceiling: `population * episodes_per_member` envs stepped `horizon` times
  with uniformly random actions and no policy, split over every device: the
  most steps/s any ES could get out of this environment here.
- podracer: the ES agent (`podracer.es.make_agent`, OpenAI-ES) on Anakin's one
  program builder (`podracer.anakin.loop.make_programs`): the population split
  over every device, fitness all-gathered; and the same on one device: the same
  algorithm as evosax's, full-rank Gaussian noise. (A run also evaluates the
  mean parameters after each call, `eval_episodes` episodes, not timed here.)
- podracer low-rank (`--low-rank`, default 1; 0 leaves the row out): the same
  on one device with `ESConfig(low_rank=r)`, EGGROLL-style rank-r noise on each
  weight matrix. NOT the algorithm evosax runs (a different search
  distribution); shown for what it costs, not as the like-for-like figure.
- evosax: `evosax.algorithms.Open_ES` ask -> `jax.vmap` of the same fitness
  function (podracer's `make_episode`, the rollout of a run's mean evaluation) -> tell, `generations`
  generations in one jitted `lax.scan`: the usual evosax loop. evosax has no
  multi-device protocol, so it runs on one device. It minimises, so it is told
  the negated returns.

Every row counts the same work: `population * episodes_per_member * horizon`
env steps per generation (steps after an episode ends are computed and masked
by both ES, and counted). The table comes first; the last line printed is one
JSON object with `sps`, `peer_sps`, `env_ceiling_sps` and generations/s. A
column of steps per CPU-second (all threads) shows what each costs in work,
which other load on a shared machine disturbs far less than wall-clock time.

    python bench/es.py                     # CartPole-v1, population 256, and the rank-1 row
    python bench/es.py --env=Pendulum-v1 --population=512 --hidden 32 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import common  # noqa: F401  (puts the repository on sys.path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--population", type=int, default=256)
    parser.add_argument("--episodes-per-member", type=int, default=1)
    parser.add_argument("--horizon", type=int, default=0, help="0: the env's time limit")
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 64])
    parser.add_argument("--generations", type=int, default=10, help="generations per timed call")
    parser.add_argument("--rounds", type=int, default=7, help="timed calls of each, interleaved")
    parser.add_argument("--cpu-devices", type=int, default=os.cpu_count() or 1,
                        help="on a CPU-only machine, JAX devices to split the CPU into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--low-rank", type=int, default=1,
                        help="rank of the extra low-rank row (0: no such row)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax

    # Before anything starts JAX's CPU backend; no effect on accelerators.
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import jax.numpy as jnp
    import optax
    from jax.flatten_util import ravel_pytree
    from jax.sharding import PartitionSpec as P

    try:
        from evosax.algorithms import Open_ES
    except ImportError:
        sys.exit("bench/es.py compares against evosax: pip install -e \".[bench]\" (or evosax)")

    from podracer.protocol import parallel
    from podracer.envs.jax_envs import make_env
    from podracer.agent import fixed_agent
    from podracer.anakin.loop import AnakinConfig, make_programs
    from podracer.anakin.train_es import make_episode
    from podracer.es.agent import episode_horizon, make_agent
    from podracer.es import ESConfig
    from podracer.networks import make_policy_network

    env = make_env(args.env)
    config = ESConfig(population=args.population, episodes_per_member=args.episodes_per_member,
                      horizon=args.horizon, generations_per_call=args.generations)
    policy = make_policy_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete,
                                 tuple(args.hidden))
    mesh = parallel.make_mesh()
    horizon = episode_horizon(env, config)
    num_devices = mesh.devices.size
    steps_per_generation = config.population * config.episodes_per_member * horizon
    steps_per_call = steps_per_generation * args.generations
    key = jax.random.PRNGKey(args.seed)

    # ---- podracer: the ES agent on Anakin's one program builder, on every device and on one.
    def podracer_call(devices, config=config):
        sizes = AnakinConfig(num_envs=config.population * config.episodes_per_member,
                             rollout_len=horizon, updates_per_call=args.generations)
        programs = make_programs(env, fixed_agent(make_agent, policy, None, config, env.spec, horizon),
                                 sizes, parallel.make_mesh(devices))
        state = {"runner": programs.init(key)}
        train = programs.train.lower(state["runner"]).compile()

        def call():
            state["runner"], metrics = train(state["runner"])
            return metrics["fitness_mean"]

        return call

    # ---- evosax Open_ES driving podracer's episode function, on one device.
    def evosax_call():
        dummy_obs = jnp.zeros(env.spec.obs_shape, env.spec.obs_dtype)
        flat, unravel = ravel_pytree(policy.init(key, dummy_obs))
        episode = make_episode(env, policy.apply, horizon, normalize=False)
        strategy = Open_ES(population_size=config.population, solution=flat,
                           optimizer=optax.adam(config.es_lr),
                           std_schedule=optax.constant_schedule(config.sigma))
        params = strategy.default_params

        def fitness(member, member_key):
            keys = jax.random.split(member_key, config.episodes_per_member)
            return jnp.mean(jax.vmap(episode, in_axes=(None, None, 0))(unravel(member), None, keys))

        def generation(es_state, generation_key):
            ask_key, eval_key, tell_key = jax.random.split(generation_key, 3)
            population, es_state = strategy.ask(ask_key, es_state, params)
            returns = jax.vmap(fitness)(population, jax.random.split(eval_key, config.population))
            es_state, _ = strategy.tell(tell_key, population, -returns, es_state, params)
            return es_state, jnp.mean(returns)

        def run(es_state, run_key):
            run_key, scan_key = jax.random.split(run_key)
            keys = jax.random.split(scan_key, args.generations)
            es_state, returns = jax.lax.scan(generation, es_state, keys)
            return es_state, run_key, returns

        device = jax.devices()[0]
        state = {"es": jax.device_put(strategy.init(key, flat, params), device),
                 "key": jax.device_put(key, device)}
        run = jax.jit(run).lower(state["es"], state["key"]).compile()

        def call():
            state["es"], state["key"], returns = run(state["es"], state["key"])
            return returns

        return call

    # ---- the environment alone: random actions, same batch and horizon, every device.
    def ceiling_call():
        batch = config.population * config.episodes_per_member
        local = parallel.split_evenly(batch, num_devices, "environments", "--population")
        axes = (parallel.DATA_AXIS,)

        def random_action(action_key):
            if env.spec.discrete:
                return jax.random.randint(action_key, (), 0, env.spec.action_dim)
            return jax.random.uniform(action_key, (env.spec.action_dim,), minval=env.spec.action_low,
                                      maxval=env.spec.action_high)

        def rollout(rollout_key):
            index = parallel.axis_offset(local, axes) + jnp.arange(local)
            keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rollout_key, index)
            env_state, _ = jax.vmap(env.reset)(keys)

            def step(env_state, step_key):
                action_keys, env_keys = jnp.split(jax.random.split(step_key, 2 * local), 2)
                actions = jax.vmap(random_action)(action_keys)
                env_state, timestep = jax.vmap(env.step)(env_keys, env_state, actions)
                return env_state, jnp.sum(timestep.reward)

            step_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
                keys[0], jnp.arange(horizon * args.generations))
            _, rewards = jax.lax.scan(step, parallel.vary(env_state, axes), step_keys)
            return parallel.psum(jnp.sum(rewards), axes)

        run = jax.jit(jax.shard_map(rollout, mesh=mesh, in_specs=P(), out_specs=P()))
        state = {"key": key}
        run = run.lower(state["key"]).compile()

        def call():
            state["key"], call_key = jax.random.split(state["key"])
            return run(call_key)

        return call

    calls = {
        "env ceiling (random actions)": ceiling_call(),
        f"podracer Anakin ES, {num_devices} devices": podracer_call(jax.devices()),
        "podracer Anakin ES, 1 device": podracer_call(jax.devices()[:1]),
        "evosax Open_ES, 1 device": evosax_call(),
    }
    low_rank_name = f"podracer low-rank ES (rank {args.low_rank}, not evosax's algorithm), 1 device"
    if args.low_rank:
        import dataclasses
        calls[low_rank_name] = podracer_call(jax.devices()[:1],
                                             dataclasses.replace(config, low_rank=args.low_rank))
    seconds = {name: [] for name in calls}
    cpu_seconds = {name: [] for name in calls}
    for name, call in calls.items():  # warm-up: first dispatch, allocations
        jax.block_until_ready(call())
    for _ in range(args.rounds):
        for name, call in calls.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            jax.block_until_ready(call())
            seconds[name].append(time.perf_counter() - start)
            cpu_seconds[name].append(time.process_time() - cpu_start)
    best = {name: min(times) for name, times in seconds.items()}
    spread = {name: statistics.median(times) / best[name] - 1 for name, times in seconds.items()}
    # Steps per second of CPU time (all threads): the work each costs, which
    # other load on a shared machine changes far less than wall-clock time.
    per_cpu_s = {name: steps_per_call / min(times) for name, times in cpu_seconds.items()}

    ceiling, ours, ours_one, peer = (steps_per_call / best[name] for name in list(calls)[:4])
    rows = [(name, f"{steps_per_call / best[name]:,.0f}", f"{args.generations / best[name]:,.1f}",
             f"{steps_per_call / best[name] / peer:.2f}x", f"{spread[name]:.0%}",
             f"{per_cpu_s[name]:,.0f}") for name in calls]
    names = list(calls)
    result = {
        "env": args.env, "population": config.population,
        "episodes_per_member": config.episodes_per_member, "horizon": horizon,
        "hidden": list(args.hidden), "devices": num_devices,
        "platform": jax.devices()[0].platform, "rounds": args.rounds,
        "sps": ours, "generations_per_s": ours / steps_per_generation,
        "sps_one_device": ours_one,
        "peer": "evosax.algorithms.Open_ES", "peer_sps": peer,
        "peer_generations_per_s": peer / steps_per_generation,
        "env_ceiling_sps": ceiling, "speedup_vs_peer": ours / peer,
        "speedup_vs_peer_one_device": ours_one / peer,
        "steps_per_cpu_s": per_cpu_s[names[1]],
        "steps_per_cpu_s_one_device": per_cpu_s[names[2]],
        "peer_steps_per_cpu_s": per_cpu_s[names[3]],
        "cpu_speedup_vs_peer_one_device": per_cpu_s[names[2]] / per_cpu_s[names[3]],
    }
    if args.low_rank:
        low = steps_per_call / best[low_rank_name]
        result.update({"low_rank": args.low_rank, "low_rank_sps_one_device": low,
                       "low_rank_speedup_vs_peer_one_device": low / peer,
                       "low_rank_cpu_speedup_vs_peer_one_device":
                           per_cpu_s[low_rank_name] / per_cpu_s[names[3]]})
    common.report(
        f"Anakin ES vs evosax, {args.env}: population {config.population} x "
        f"{config.episodes_per_member} episode(s) x horizon {horizon}, {args.generations} "
        f"generations per call, policy MLP {tuple(args.hidden)}, {num_devices} devices; "
        f"best of {args.rounds} interleaved calls",
        rows, ("run", "env steps/s", "generations/s", "vs evosax", "median +", "steps/CPU-s"),
        result)
    return result


if __name__ == "__main__":
    from podracer.errors import PodracerError

    try:
        main()
    except PodracerError as err:  # e.g. a population that does not split over the devices
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
