"""Use a trained policy: `load_policy(run_dir)` returns a pure `act(obs, key)`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from podracer import storage
from podracer.session.checkpoint import (Checkpointer, CheckpointConfig, checkpoint_dir, has_checkpoint,
                                         restore_on_host)
from podracer.acting import RecurrentPolicy, make_es_act  # noqa: F401 (RecurrentPolicy: load_policy's)
from podracer.algorithms import ALGORITHMS
from podracer.bounds import POSITIVE, SEED, bounded, check_bounds
from podracer.errors import PodracerError
from podracer.normalize import RunningStats


def read_run(run_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, restored state as plain nested dicts) of the latest checkpoint in `run_dir` (local or gs://)."""
    if not storage.isdir(run_dir):
        raise PodracerError(f"--run-dir={run_dir} does not exist; pass the directory of a finished run")
    if not has_checkpoint(run_dir):
        raise PodracerError(f"{run_dir} has no checkpoint; train with --run-dir={run_dir} first")
    checkpointer = Checkpointer(run_dir, CheckpointConfig(), {}, create=False)
    step = checkpointer.latest_step()
    meta = checkpointer.read_meta(step)
    checkpointer.close()
    try:
        state = restore_on_host(storage.join(checkpoint_dir(run_dir), str(step), "state"))
    except Exception as err:
        raise PodracerError(f"checkpoint {step} in {checkpoint_dir(run_dir)} is unreadable "
                            f"({type(err).__name__}); delete it to fall back to an older one") from None
    return meta, state


def env_spec_of(arch: str, env_id: str):
    """The spaces of the run's environment: gymnax for Anakin, envpool for Sebulba."""
    if arch == "sebulba":
        from podracer.sebulba.envs import env_spec

        return env_spec(env_id)
    from podracer.envs.jax_envs import make_env

    return make_env(env_id).spec


def _tuples(section: dict[str, Any]) -> dict[str, Any]:
    """A saved config section's fields, its lists (JSON's tuples) as tuples again."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in section.items()}


def _network_config(record: dict[str, Any]):
    from podracer.config import NetworkConfig

    return NetworkConfig(**_tuples(record["network"]))


def _stats(saved: dict[str, Any]) -> RunningStats:
    """Observation statistics from a checkpoint's dict (`count`, `mean`, `sum_squared_deviations`)."""
    return RunningStats(**{k: jnp.asarray(v) for k, v in saved.items()})


def _es_policy(record: dict[str, Any], spec, mean, obs_stats: dict[str, Any]) -> Callable:
    """The ES search distribution's mean, acting as it was evaluated (deterministically)."""
    from podracer.es.config import ESConfig

    es_act = make_es_act(ESConfig(**record["es"]), _network_config(record), spec)
    mean, stats = jnp.asarray(mean), _stats(obs_stats)

    def act(obs: jax.Array, key: jax.Array) -> jax.Array:
        """Actions for a batch of observations [B, ...]; `key` is unused (ES policies are deterministic)."""
        del key
        return es_act(mean, stats, obs)

    return act


def best_agent(run_dir: str) -> int:
    """The agent of a finished population run with the best final score (its summary.json's `agents`)."""
    import json

    path = storage.join(run_dir, "summary.json")
    summary = json.loads(storage.read_text(path)) if storage.exists(path) else {}
    key = summary.get("score_key", "episode_return_mean")
    scored = [(a[key], a["agent"]) for a in summary.get("agents") or () if a.get(key) is not None]
    if not scored:
        raise PodracerError(f"{run_dir} has no summary.json with its agents' final scores to pick the best "
                            f"from; finish the run, or pick one with agent=I (--agent=I)")
    return max(scored, key=lambda s: (s[0], -s[1]))[1]  # ties: the lowest index


def select_agent(run_dir: str, record: dict[str, Any], state: dict[str, Any], agent: int | str | None):
    """The state of agent `agent` of a population run (leading axis of every array; "best":
    `best_agent`); a run of one agent's own state. One-line errors for a missing or impossible `agent`."""
    population = record.get("population")
    if agent == "best":
        agent = best_agent(run_dir) if population else None
    if not population:
        if agent not in (None, 0):
            raise PodracerError(f"{run_dir} trained one agent; drop agent={agent} (--agent)")
        return state
    num_agents = len(jax.tree.leaves(state)[0])
    if agent is None:
        raise PodracerError(f"{run_dir} trained a population of {num_agents} agents; pick one with "
                            f"agent=I (--agent=I), 0 <= I < {num_agents} (summary.json lists them)")
    if not 0 <= agent < num_agents:
        raise PodracerError(f"agent={agent} is not in the population of {num_agents} agents of {run_dir}; "
                            f"use 0 <= I < {num_agents}")
    return jax.tree.map(lambda x: x[agent], state)


def load_policy(run_dir: str, deterministic: bool = False, agent: int | str | None = None) -> Callable:
    """A pure, jittable `act(obs, key) -> actions` from the run's latest checkpoint.

    `run_dir` is a local directory or `gs://bucket/path`.

    Works for every architecture and algorithm. Observations are a batch
    [B, ...] as the run's environment yields them (gymnax for Anakin, envpool
    for Sebulba). For PPO, `deterministic=True` takes the most likely (or mean)
    action instead of a sample; an ES run acts with the mean of its search
    distribution, deterministically, as its evaluation episodes did. A
    population run (`--num-seeds`, `--sweep`) holds many agents: `agent` picks
    one (its index in summary.json's `agents`), or "best" the one with the
    best final score.
    """
    meta, state = read_run(run_dir)
    record = meta["config"]
    state = select_agent(run_dir, record, state, agent)
    arch, algo = record["run"]["arch"], record["run"]["algo"]
    spec = env_spec_of(arch, record["run"]["env"])
    if algo in ALGORITHMS:
        entry = ALGORITHMS[algo]
        network = entry.make_network(spec, _network_config(record))
        return entry.load_policy(network, entry.config(**_tuples(record[algo])), state["train"], deterministic)
    if algo == "es":  # the agent's state: Anakin's runner holds it as "train"
        es_state = state.get("train", state)
        return _es_policy(record, spec, es_state["strategy"]["mean"], es_state["obs_stats"])
    raise PodracerError(f"{run_dir} was made by --arch={arch} --algo={algo}, which load_policy "
                        f"does not know; evaluate it with the podracer version that trained it")


def run_config_of(run_dir: str) -> dict[str, Any]:
    """The run's saved config, by section."""
    return read_run(run_dir)[0]["config"]


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """`python launch/tpu.py eval --run-dir=DIR --episodes=N`."""

    run_dir: str = "runs/latest"
    """The run to evaluate (its latest checkpoint; runs/latest is the newest run)."""
    episodes: int = bounded(10, POSITIVE)
    """Episodes to average over."""
    seed: int = bounded(0, SEED)
    """Seed for the environments and sampled actions."""
    deterministic: bool = False
    """Take the most likely action instead of sampling."""
    agent: str = ""
    """The agent of a population run to evaluate: its index in summary.json's agents, or best (the best final score); empty: the run's only agent."""
    video: str = ""
    """Play the evaluation's episodes one after another and write them to this .mp4 or .gif, the return drawn on each frame; the mean printed is theirs (gymnax classic control, navix, craftax, brax, envpool Atari; pip install -e ".[video]")."""

    def __post_init__(self):
        check_bounds(self)
        if self.agent not in ("", "best") and not (self.agent.isdigit() and self.agent.isascii()):
            raise ValueError(f"--agent must be an agent's index (0, 1, ...) or best, got {self.agent}")

    def chosen_agent(self) -> int | str | None:
        return None if self.agent == "" else "best" if self.agent == "best" else int(self.agent)
