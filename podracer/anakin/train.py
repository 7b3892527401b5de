"""Host drivers for Anakin PPO and ES: build, compile, call, log."""

from __future__ import annotations

import math
import time

import jax
import numpy as np

from podracer import parallel
from podracer.anakin.env import make_env
from podracer.anakin.es import make_anakin_es, make_es_layout
from podracer.anakin.loop import AnakinConfig, make_anakin, make_layout
from podracer.config import NetworkConfig, OptimConfig, RunConfig, make_optimizer
from podracer.errors import PodracerError
from podracer.es.config import ESConfig
from podracer.logger import RunLogger, prepare_run_dir
from podracer.networks import make_network, make_policy_network
from podracer.ppo import PPOConfig


def _interval_metrics(metrics) -> dict:
    """Reduce one call's stacked per-update metrics to one log row."""
    metrics = jax.device_get(metrics)
    episodes = int(np.sum(metrics.pop("episodes")))
    return_sum = float(np.sum(metrics.pop("episode_return_sum")))
    length_sum = float(np.sum(metrics.pop("episode_length_sum")))
    row = {key: float(np.mean(value)) for key, value in metrics.items()}
    row["episodes"] = episodes
    row["episode_return_mean"] = return_sum / episodes if episodes else None
    row["episode_length_mean"] = length_sum / episodes if episodes else None
    return row


def train_ppo(run: RunConfig, ppo_config: PPOConfig, anakin: AnakinConfig,
              optim: OptimConfig, net: NetworkConfig, devices=None):
    """Train PPO with Anakin on `devices` (default: all); returns (summary, final runner)."""
    if run.total_steps <= 0:
        raise PodracerError(f"--total-steps must be positive, got {run.total_steps}")
    env = make_env(run.env)
    mesh = parallel.make_mesh(devices)
    layout = make_layout(anakin, ppo_config, mesh)
    steps_per_call = layout.steps_per_update * anakin.updates_per_call
    num_calls = max(1, math.ceil(run.total_steps / steps_per_call))
    num_updates = num_calls * anakin.updates_per_call
    prepare_run_dir(run.run_dir)
    logger = RunLogger(run.run_dir, num_calls * steps_per_call)

    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete,
                           net.hidden, net.activation)
    optimizer = make_optimizer(optim, num_updates * ppo_config.epochs * ppo_config.minibatches)
    init, train = make_anakin(env, network, optimizer, ppo_config, anakin, mesh)

    runner = init(jax.random.PRNGKey(run.seed))
    compile_start = time.perf_counter()
    train = train.lower(runner).compile()
    compile_s = time.perf_counter() - compile_start

    # Dispatch call i+1 before reading call i's metrics, so logging overlaps compute.
    train_start = time.perf_counter()
    runner, metrics = train(runner)
    last_return = None
    for call in range(num_calls):
        pending = metrics
        if call + 1 < num_calls:
            runner, metrics = train(runner)
        row = _interval_metrics(pending)
        env_steps = (call + 1) * steps_per_call
        elapsed = time.perf_counter() - train_start
        row.update(env_steps=env_steps, sps=env_steps / elapsed)
        if row["episode_return_mean"] is not None:
            last_return = row["episode_return_mean"]
        logger.log(row)
    jax.block_until_ready(runner)
    train_s = time.perf_counter() - train_start
    return logger.summary({
        "arch": "anakin", "algo": "ppo", "env": run.env,
        "env_steps": num_calls * steps_per_call,
        "sps": num_calls * steps_per_call / train_s,
        "episode_return_mean": last_return,
        "updates": num_updates,
        "devices": layout.num_devices,
        "compile_s": compile_s,
        "train_s": train_s,
    }), runner


def _es_row(metrics) -> dict:
    """One call's ES metrics (stacked over its generations) as one log row."""
    metrics = jax.device_get(metrics)
    row = {"mean_params_return": float(metrics.pop("mean_params_return"))}
    row["episode_return_mean"] = float(np.mean(metrics["fitness_mean"]))
    row["episode_return_max"] = float(np.max(metrics.pop("fitness_max")))
    row["episode_return_min"] = float(np.min(metrics.pop("fitness_min")))
    row.update({key: float(np.mean(value)) for key, value in metrics.items()})
    return row


def train_es(run: RunConfig, es_config: ESConfig, net: NetworkConfig, devices=None):
    """Train a policy with evolution strategies on Anakin; returns (summary, final runner).

    `env_steps` counts the steps the population simulates (`population *
    episodes_per_member * horizon` per generation, steps after an episode's end
    included: they are computed and masked); the evaluation episodes of the mean
    parameters are extra and not counted. `episode_return_mean` is the mean
    fitness of the population over the call's generations, `mean_params_return`
    the return of the mean parameters after the call.
    """
    if run.total_steps <= 0:
        raise PodracerError(f"--total-steps must be positive, got {run.total_steps}")
    env = make_env(run.env)
    mesh = parallel.make_mesh(devices)
    layout = make_es_layout(es_config, env, mesh)
    steps_per_call = layout.steps_per_generation * es_config.generations_per_call
    num_calls = max(1, math.ceil(run.total_steps / steps_per_call))
    prepare_run_dir(run.run_dir)
    logger = RunLogger(run.run_dir, num_calls * steps_per_call)

    policy = make_policy_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete,
                                 net.hidden, net.activation)
    init, step = make_anakin_es(env, policy, es_config, mesh)
    runner = init(jax.random.PRNGKey(run.seed))
    compile_start = time.perf_counter()
    step = step.lower(runner).compile()
    compile_s = time.perf_counter() - compile_start

    # Dispatch call i+1 before reading call i's metrics, so logging overlaps compute.
    train_start = time.perf_counter()
    runner, metrics = step(runner)
    row = {}
    for call in range(num_calls):
        pending = metrics
        if call + 1 < num_calls:
            runner, metrics = step(runner)
        row = _es_row(pending)
        generations = (call + 1) * es_config.generations_per_call
        elapsed = time.perf_counter() - train_start
        row.update(env_steps=(call + 1) * steps_per_call, generations=generations,
                   sps=(call + 1) * steps_per_call / elapsed, generations_per_s=generations / elapsed)
        logger.log(row)
    jax.block_until_ready(runner)
    train_s = time.perf_counter() - train_start
    generations = num_calls * es_config.generations_per_call
    return logger.summary({
        "arch": "anakin", "algo": "es", "variant": es_config.variant, "env": run.env,
        "env_steps": num_calls * steps_per_call,
        "sps": num_calls * steps_per_call / train_s,
        "episode_return_mean": row["episode_return_mean"],
        "mean_params_return": row["mean_params_return"],
        "generations": generations,
        "generations_per_s": generations / train_s,
        "population": es_config.population,
        "horizon": layout.horizon,
        "num_params": int(runner.strategy.mean.shape[0]),
        "devices": layout.num_devices,
        "compile_s": compile_s,
        "train_s": train_s,
    }), runner
