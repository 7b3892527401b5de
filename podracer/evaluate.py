"""Evaluate a policy for whole episodes: the `eval` verb and tests."""

from __future__ import annotations

import json
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from podracer.errors import PodracerError



def gymnax_returns(act: Callable, env_id: str, episodes: int, seed: int = 0) -> np.ndarray:
    """Undiscounted return of the first episode of `episodes` parallel gymnax envs."""
    from podracer.envs.jax_envs import make_env

    env = make_env(env_id)
    horizon = env.horizon
    recurrent = hasattr(act, "initial_carry")  # `policy.RecurrentPolicy`: its state goes along

    @jax.jit
    def run(key):
        reset_key, key = jax.random.split(key)
        state, ts = jax.vmap(env.reset)(jax.random.split(reset_key, episodes))

        def step(carry, key):
            state, obs, total, alive, memory = carry
            act_key, env_key = jax.random.split(key)
            if recurrent:
                action, memory = act(obs, act_key, memory)
            else:
                action = act(obs, act_key)
            # As Anakin's rollout steps a batch (a costly reset, Craftax's, only where an episode ended).
            draws = jax.vmap(env.draw)(jax.random.split(env_key, episodes))
            state, ts = env.step_batch(draws, state, action)
            total = total + jnp.where(alive, ts.reward, 0.0)
            alive = alive & ~(ts.terminated | ts.truncated)
            return (state, ts.obs, total, alive, memory), None

        memory = act.initial_carry(episodes) if recurrent else ()
        init = (state, ts.obs, jnp.zeros(episodes), jnp.ones(episodes, bool), memory)
        (_, _, total, _, _), _ = jax.lax.scan(step, init, jax.random.split(key, horizon))
        return total

    return np.asarray(run(jax.random.PRNGKey(seed)))


def envpool_returns(act: Callable, env_id: str, episodes: int, seed: int = 0) -> np.ndarray:
    """Return of the first episode of `episodes` envpool environments (Atari: the game score).

    Every environment plays until its first episode ends; the others keep
    stepping (envpool steps the batch) but count no more.
    """
    from podracer.sebulba.envs import EnvPoolEnvs
    from podracer.sebulba.envs import EpisodeTally, in_env_order

    envs = EnvPoolEnvs(env_id, episodes, episodes, 0, seed=seed)
    memory = act.initial_carry(episodes) if hasattr(act, "initial_carry") else None  # a recurrent policy's state
    act = jax.jit(act)
    tally, slots, key = EpisodeTally(episodes), np.arange(episodes, dtype=np.int32), jax.random.PRNGKey(seed)
    try:
        envs.start()
        while True:
            step = in_env_order(envs.recv())
            tally.record(step)
            if tally.done:
                return tally.returns.copy()
            key, act_key = jax.random.split(key)
            if memory is not None:  # each environment's first episode only: no reset needed
                action, memory = act(step.obs, act_key, memory)
            else:
                action = act(step.obs, act_key)
            envs.send(np.asarray(action), slots)
    finally:
        envs.close()


def main(argv) -> int:
    """`eval --run-dir=DIR --episodes=N`: print the mean return as a line and JSON."""
    from podracer.orchestrate.flags import parse_section
    from podracer.policy import EvalConfig, load_policy, run_config_of

    config: EvalConfig = parse_section(EvalConfig, argv, prog="podracer eval")
    if config.video:
        from podracer.video import check_path

        check_path(config.video)
    agent = config.chosen_agent()
    if agent == "best":  # a population's best agent, by index; a run of one agent its own
        from podracer.policy import best_agent

        agent = best_agent(config.run_dir) if run_config_of(config.run_dir).get("population") else None
    act = load_policy(config.run_dir, config.deterministic, agent)
    if config.video and hasattr(act, "initial_carry"):
        raise PodracerError("eval --video draws feed-forward policies; this run's network is recurrent: "
                            "evaluate it without --video")
    run = run_config_of(config.run_dir)["run"]
    written = None
    if config.video:
        # The episodes in the video are the ones evaluated: its returns are the printed mean's.
        # An environment it cannot draw is refused before any of them is played.
        from podracer import video

        record = video.envpool_video if run["arch"] == "sebulba" else video.anakin_video
        written = record(act, run["env"], config.episodes, config.seed, config.video)
        returns = np.asarray(written["episode_returns"], float)
    else:
        returns_of = envpool_returns if run["arch"] == "sebulba" else gymnax_returns
        returns = returns_of(act, run["env"], config.episodes, config.seed)
    print(f"{run['env']}: mean return {returns.mean():.2f} +- {returns.std():.2f} over {len(returns)} episodes")
    print(json.dumps({"env": run["env"], **({"agent": agent} if agent is not None else {}),
                      "episodes": len(returns), "episode_return_mean": float(returns.mean()),
                      "episode_return_std": float(returns.std())}))
    if written is not None:
        print(f"wrote {config.video}: {len(written['episode_lengths'])} episodes, {written['frames']} frames")
        print(json.dumps(written))
    sys.stdout.flush()
    return 0
