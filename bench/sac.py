"""podracer's Anakin SAC against brax's own SAC trainer on a brax environment, alternated in one process.

Both train SAC on brax `inverted_pendulum` (spring backend) with the same
settings: 8 environments, 64x64 ReLU MLPs, minibatches of 128, 4 gradient
steps per step of the 8 environments (one per two transitions), Adam at 1e-3,
gamma 0.99, tau 0.005, 1,024 transitions before learning, a buffer of 100k.
brax (`brax.training.agents.sac.train`) acts one step and learns 4 times per
iteration; podracer runs that same layout (`--rollout-len=1
--updates-per-rollout=4`), and its preset's (rollouts of 8 steps, 32 gradient
steps after each) in a second row.

The two run in equal chunks of 2,048 environment steps, alternated: between two
of brax's epochs (its `progress_fn`) each podracer program runs one call. brax's
figure is its own `training/sps` (its epoch timed by itself, without its
evaluation); podracer's is its call, compiled beforehand. Each is the median
over the chunks after the first (brax compiles in its first). The returns are
brax's last evaluation (8 episodes, sampled actions) and the episodes that ended
in podracer's last chunk (also sampled; a chunk in which none ended keeps the
one before's). `time_to_score_s` is the training time until a return reaches
SCORE: brax's own `training/walltime` at the first evaluation that does
(its prefill and compiling epoch included, its evaluations not), and
podracer's compilation plus its chunks up to the first that does; null if
none does within the rounds.

    python bench/sac.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
import warnings
from typing import Any, Callable, NamedTuple

import common  # noqa: F401  (puts the repository on sys.path)
import jax
import numpy as np

from envs import brax_trainer
from podracer import sac
from podracer.envs.jax_envs import make_env
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.config import OptimConfig, make_optimizer
from podracer.protocol import parallel

ENV = "inverted_pendulum"
NUM_ENVS, BATCH, UPDATES_PER_STEP, LR, HIDDEN, PREFILL, BUFFER = 8, 128, 4, 1e-3, (64, 64), 1024, 100_000
CHUNK_STEPS = 2048  # environment steps per chunk, each side
SCORE = 50.0  # the return `time_to_score_s` waits for: steps with the pole up, of 1,000 (untrained: about 20)


class Compiled(NamedTuple):
    train: Callable  # the compiled call of CHUNK_STEPS environment steps
    runner: Any  # its first input
    compile_s: float


def podracer_sac(rollout_len: int) -> Compiled:
    """podracer's compiled SAC call of CHUNK_STEPS environment steps, its runner and its compile time."""
    env = make_env(f"brax:{ENV}")
    networks = sac.make_networks(env.spec.obs_shape, env.spec.action_dim, HIDDEN, "relu", env.spec.action_low,
                                 env.spec.action_high)
    config = sac.SACConfig(buffer_size=BUFFER, batch_size=BATCH, learning_starts=PREFILL,
                           updates_per_rollout=UPDATES_PER_STEP * rollout_len)
    # Adam as brax's (no clipping: a norm no gradient reaches; its epsilon).
    optimizer = make_optimizer(OptimConfig(lr=LR, anneal_lr=False, max_grad_norm=1e9, adam_eps=1e-8), 1)
    anakin = AnakinConfig(num_envs=NUM_ENVS, rollout_len=rollout_len,
                          updates_per_call=CHUNK_STEPS // (NUM_ENVS * rollout_len))
    programs = make_programs(env, lambda _h, axes: sac.make_agent(networks, optimizer, config, env.spec,
                                                                  rollout_len, axes),
                             anakin, parallel.make_mesh(jax.devices()[:1]))
    runner = programs.init(jax.random.PRNGKey(0))
    start = time.perf_counter()
    train = programs.train.lower(runner).compile()
    return Compiled(train, runner, time.perf_counter() - start)


def time_to_score(start_s: float, seconds: list[float], returns: list[float | None]) -> float | None:
    """`start_s` plus the seconds of the chunks up to the first whose return reaches SCORE (None if none does)."""
    for elapsed, value in zip(itertools.accumulate(seconds), returns):
        if value is not None and value >= SCORE:
            return start_s + elapsed
    return None


def side_by_side(rounds: int) -> dict:
    ours = {name: podracer_sac(rollout_len) for name, rollout_len in (("same layout", 1), ("preset layout", 8))}
    runners = {name: compiled.runner for name, compiled in ours.items()}
    our_seconds = {name: [] for name in ours}
    our_returns = {name: [] for name in ours}  # per chunk: its ended episodes' mean, the last one if none ended
    brax_sps, brax_return, brax_walltime = [], [], []

    def between_epochs(step, metrics):
        if "training/sps" not in metrics:  # the evaluation before training
            return
        brax_sps.append(float(metrics["training/sps"]))
        brax_return.append(float(metrics["eval/episode_reward"]))
        brax_walltime.append(float(metrics["training/walltime"]))  # its training so far: prefill, compiling epoch
        for name, compiled in ours.items():
            (runners[name], out), seconds = common.timed(compiled.train, runners[name])
            our_seconds[name].append(seconds)
            episodes = int(np.sum(out["episodes"]))
            last = our_returns[name][-1] if our_returns[name] else None
            our_returns[name].append(float(np.sum(out["episode_return_sum"])) / episodes if episodes else last)

    from brax import envs
    from brax.training.agents.sac import networks as sac_networks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = envs.get_environment(ENV, backend="spring")
    factory = lambda *a, **k: sac_networks.make_sac_networks(*a, **k, hidden_layer_sizes=HIDDEN)
    brax_trainer("sac")(
        environment=env, num_timesteps=PREFILL + (rounds + 1) * CHUNK_STEPS, episode_length=1000,
        num_envs=NUM_ENVS, num_eval_envs=8, learning_rate=LR, discounting=0.99, batch_size=BATCH,
        num_evals=rounds + 2, tau=0.005, min_replay_size=PREFILL, max_replay_size=BUFFER,
        grad_updates_per_step=UPDATES_PER_STEP, network_factory=factory, progress_fn=between_epochs, seed=0)
    # brax's first epoch compiled its program: that round is left out of every side's speed.
    brax_reached = next((t for t, r in zip(brax_walltime, brax_return) if r >= SCORE), None)
    return {"brax_sps": statistics.median(brax_sps[1:]), "brax_return": brax_return[-1],
            "brax_time_to_score_s": brax_reached,
            **{name: {"sps": statistics.median([CHUNK_STEPS / t for t in seconds[1:]]),
                      "return": our_returns[name][-1],
                      "time_to_score_s": time_to_score(ours[name].compile_s, seconds, our_returns[name])}
               for name, seconds in our_seconds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="alternating chunks of 2,048 steps a side")
    args = parser.parse_args()
    measured = side_by_side(args.rounds)
    rows, result = [], []
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    for name in ("same layout", "preset layout"):
        ours = measured[name]
        rows.append((f"brax:{ENV}, {name}", f"{ours['sps']:,.0f}", f"{measured['brax_sps']:,.0f}",
                     f"{ours['sps'] / measured['brax_sps']:.2f}", fmt(ours["time_to_score_s"]),
                     fmt(measured["brax_time_to_score_s"]), fmt(ours["return"]), fmt(measured["brax_return"])))
        result.append({"algo": "sac", "env": f"brax:{ENV}", "layout": name, "sps": ours["sps"],
                       "peer": "brax.training.agents.sac", "peer_sps": measured["brax_sps"],
                       "ratio": ours["sps"] / measured["brax_sps"], "score": SCORE,
                       "time_to_score_s": ours["time_to_score_s"],
                       "peer_time_to_score_s": measured["brax_time_to_score_s"], "return": ours["return"],
                       "peer_return": measured["brax_return"], "env_steps": (args.rounds + 1) * CHUNK_STEPS,
                       "rounds": args.rounds})
    common.report("Anakin SAC against brax's SAC trainer, alternated chunks", rows,
                  ("run", "sps", "peer_sps", "ratio", f"time to {SCORE:g} s", f"peer time to {SCORE:g} s",
                   "return", "peer_return"), {"rows": result})


if __name__ == "__main__":
    main()
