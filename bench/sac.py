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
in podracer's last chunk (also sampled).

    python bench/sac.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import warnings

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


def podracer_sac(rollout_len: int):
    """podracer's compiled SAC call of CHUNK_STEPS environment steps, and its runner."""
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
    train = programs.train.lower(runner).compile()
    return train, runner


def side_by_side(rounds: int) -> dict:
    ours = {name: podracer_sac(rollout_len) for name, rollout_len in (("same layout", 1), ("preset layout", 8))}
    runners = {name: runner for name, (_, runner) in ours.items()}
    our_sps = {name: [] for name in ours}
    our_return = {}
    brax_sps, brax_return = [], []

    def between_epochs(step, metrics):
        if "training/sps" not in metrics:  # the evaluation before training
            return
        brax_sps.append(float(metrics["training/sps"]))
        brax_return.append(float(metrics["eval/episode_reward"]))
        for name, (train, _) in ours.items():
            (runners[name], out), seconds = common.timed(train, runners[name])
            our_sps[name].append(CHUNK_STEPS / seconds)
            episodes = int(np.sum(out["episodes"]))
            our_return[name] = float(np.sum(out["episode_return_sum"])) / max(episodes, 1)

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
    # brax's first epoch compiled its program: that round is left out of every side.
    return {"brax_sps": statistics.median(brax_sps[1:]), "brax_return": brax_return[-1],
            **{name: {"sps": statistics.median(sps[1:]), "return": our_return[name]}
               for name, sps in our_sps.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="alternating chunks of 2,048 steps a side")
    args = parser.parse_args()
    measured = side_by_side(args.rounds)
    rows, result = [], []
    for name in ("same layout", "preset layout"):
        ours = measured[name]
        rows.append((f"brax:{ENV}, {name}", f"{ours['sps']:,.0f}", f"{measured['brax_sps']:,.0f}",
                     f"{ours['sps'] / measured['brax_sps']:.2f}", f"{ours['return']:.1f}",
                     f"{measured['brax_return']:.1f}"))
        result.append({"algo": "sac", "env": f"brax:{ENV}", "layout": name, "sps": ours["sps"],
                       "peer": "brax.training.agents.sac", "peer_sps": measured["brax_sps"],
                       "ratio": ours["sps"] / measured["brax_sps"], "return": ours["return"],
                       "peer_return": measured["brax_return"], "env_steps": (args.rounds + 1) * CHUNK_STEPS,
                       "rounds": args.rounds})
    common.report("Anakin SAC against brax's SAC trainer, alternated chunks", rows,
                  ("run", "sps", "peer_sps", "ratio", "return", "peer_return"), {"rows": result})


if __name__ == "__main__":
    main()
