"""Use a trained policy: `load_policy(run_dir)` returns a pure `act(obs, key)`."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from podracer.checkpoint import (Checkpointer, CheckpointConfig, checkpoint_dir, has_checkpoint,
                                 restore_on_host)
from podracer.errors import PodracerError
from podracer.normalize import RunningStats


def read_run(run_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, restored state as plain nested dicts) of the latest checkpoint in `run_dir`."""
    if not os.path.isdir(run_dir):
        raise PodracerError(f"--run-dir={run_dir} does not exist; pass the directory of a finished run")
    if not has_checkpoint(run_dir):
        raise PodracerError(f"{run_dir} has no checkpoint; train with --run-dir={run_dir} first")
    checkpointer = Checkpointer(run_dir, CheckpointConfig(), {}, create=False)
    step = checkpointer.latest_step()
    meta = checkpointer.read_meta(step)
    checkpointer.close()
    try:
        state = restore_on_host(os.path.join(checkpoint_dir(run_dir), str(step), "state"))
    except Exception as err:
        raise PodracerError(f"checkpoint {step} in {checkpoint_dir(run_dir)} is unreadable "
                            f"({type(err).__name__}); delete it to fall back to an older one") from None
    return meta, state


def _ppo_policy(configs: dict[str, Any], state: dict[str, Any], deterministic: bool) -> Callable:
    from podracer.anakin.env import make_env
    from podracer.config import NetworkConfig
    from podracer.networks import make_network
    from podracer.ppo import PPOConfig, make_act

    ppo_config = PPOConfig(**configs["ppo"])
    net = NetworkConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in configs["network"].items()})
    env = make_env(configs["run"]["env"])
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete,
                           net.hidden, net.activation)
    params = jax.tree.map(jnp.asarray, state["train"]["params"])
    obs_stats = RunningStats(**{k: jnp.asarray(v) for k, v in state["train"]["obs_stats"].items()})
    act_batch = make_act(network.apply, ppo_config, deterministic)

    def act(obs: jax.Array, key: jax.Array) -> jax.Array:
        """Actions for a batch of observations [B, ...]."""
        keys = jax.random.split(key, obs.shape[0])
        return act_batch(params, obs_stats, obs, keys)[0]

    return act


def load_policy(run_dir: str, deterministic: bool = False) -> Callable:
    """A pure, jittable `act(obs, key) -> actions` from the run's latest checkpoint.

    Observations are a batch [B, ...] as the run's environment yields them;
    `deterministic=True` takes the most likely (or mean) action instead of a sample.
    """
    meta, state = read_run(run_dir)
    configs = meta["config"]
    arch, algo = configs["run"]["arch"], configs["run"]["algo"]
    if (arch, algo) == ("anakin", "ppo"):
        return _ppo_policy(configs, state, deterministic)
    raise PodracerError(f"load_policy does not yet support --arch={arch} --algo={algo} runs")


def run_config_of(run_dir: str) -> dict[str, Any]:
    """The run's saved config, by section."""
    return read_run(run_dir)[0]["config"]


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """`python launch/tpu.py eval --run-dir=DIR --episodes=N`."""

    run_dir: str = "runs/latest"
    """The run to evaluate (its latest checkpoint)."""
    episodes: int = 10
    """Episodes to average over."""
    seed: int = 0
    """Seed for the environments and sampled actions."""
    deterministic: bool = False
    """Take the most likely action instead of sampling."""
