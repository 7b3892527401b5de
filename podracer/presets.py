"""Per-environment defaults: what a user gets without tuning anything.

A preset only replaces dataclass defaults; any flag given on the command line
wins over it. Keys are (arch, algo, env id).
"""

from __future__ import annotations

from typing import Any

# Sebulba presets use environment counts that split over 1, 2, 3, 4, 6 or 8 learner
# devices: the default splits of 1, 4 and 8 devices per host (one learner shared
# with the actors; 1 actor and 3 learners; 2 and 6) included.
_ATARI = {
    "num_envs": 24, "rollout_len": 128, "lr": 2.5e-4, "clip_eps": 0.1, "ent_coef": 0.01,
    "epochs": 4, "minibatches": 4, "unroll_minibatches": True, "total_steps": 10_000_000,
    "env_threads": 2}

_SAC_SMALL = {
    "num_envs": 8, "rollout_len": 8, "updates_per_call": 16, "updates_per_rollout": 32, "batch_size": 128,
    "hidden": (64, 64), "activation": "relu", "lr": 1e-3, "anneal_lr": False, "total_steps": 20_000}

PRESETS: dict[tuple[str, str, str], dict[str, Any]] = {
    # Solves (mean return 500) in about 10 s of training on a 2-core laptop CPU.
    ("anakin", "ppo", "CartPole-v1"): {"num_envs": 32, "rollout_len": 32, "lr": 1e-3},
    # Pendulum needs a short horizon and unclipped, large value targets.
    ("anakin", "ppo", "Pendulum-v1"): {
        "gamma": 0.9, "clip_value": False, "ent_coef": 0.0, "lr": 1e-3, "num_envs": 32,
        "rollout_len": 64, "epochs": 10, "minibatches": 4, "total_steps": 1_000_000},
    # Sebulba: envpool environments on host threads. Many environments per actor
    # thread amortise each policy call; no entropy bonus keeps the solved policy at 500.
    ("sebulba", "ppo", "CartPole-v1"): {
        "num_envs": 120, "rollout_len": 32, "lr": 1e-3, "ent_coef": 0.0, "total_steps": 2_000_000,
        "log_every": 4},
    # Atari: Nature-CNN; the unrolled minibatch loop keeps XLA:CPU's convolution
    # gradients fast (about 14x slower inside a rolled scan).
    ("sebulba", "ppo", "Pong-v5"): _ATARI,
    ("sebulba", "ppo", "Breakout-v5"): _ATARI,
    # MuJoCo: long rollouts, many small minibatches, standardised observations;
    # value targets of a few hundred are learned unclipped.
    ("sebulba", "ppo", "HalfCheetah-v5"): {
        "num_envs": 24, "rollout_len": 128, "epochs": 10, "minibatches": 8, "lr": 3e-4,
        "ent_coef": 0.0, "clip_value": False, "normalize_observations": True,
        "total_steps": 1_000_000, "env_threads": 2, "log_every": 5},
    # IMPALA (V-trace): the actor-critic of PPO's presets, in minibatches of whole
    # environment columns. Without PPO's clip, more than one pass over a batch made
    # Sebulba's CartPole policy collapse now and then (to one action, return 9).
    ("anakin", "impala", "CartPole-v1"): {"num_envs": 32, "rollout_len": 32, "lr": 1e-3, "minibatches": 4,
                                          "epochs": 2},
    # With 8 minibatches: mean return 500 within 200-400k steps (seeds 0-5); the 2M
    # steps take about 12 s of training on a 2-core CPU. Without a trust region a
    # solved policy can still collapse (one run in nine, to return 9). Now 4 minibatches
    # of whole columns, so that each learner device's 120, 40 or 20 environments (1, 4
    # or 8 devices: one, three or six learners) split into them; seed 0 still reaches
    # 475 (tests/test_impala.py), the other seeds are not measured again.
    ("sebulba", "impala", "CartPole-v1"): {
        "num_envs": 120, "rollout_len": 32, "lr": 1e-3, "minibatches": 4, "epochs": 1,
        "total_steps": 2_000_000, "log_every": 4},
    ("sebulba", "impala", "Pong-v5"): {
        **{k: v for k, v in _ATARI.items() if k not in ("clip_eps", "epochs", "minibatches", "unroll_minibatches")},
        "rollout_len": 32, "lr": 6e-4, "epochs": 1, "minibatches": 1},
    # SAC: small networks and many gradient steps per rollout (32 per 64 transitions). Mean
    # return about -150 after 10-16k steps, about 10 s of training on a 2-core CPU.
    ("anakin", "sac", "Pendulum-v1"): _SAC_SMALL,
    # The spring backend's pole: untrained it stays up about 20 steps, after 10-20k steps
    # of SAC about 60 (PPO's figure too, tests/test_suites_learn.py).
    ("anakin", "sac", "brax:inverted_pendulum"): _SAC_SMALL,
    # DQN: 16-step returns cut from 16-step rollouts of 8 environments, two gradient steps
    # per rollout, the learning rate decayed over 400k steps. Seeds 0-3 of a population
    # reached 475 within 150-180k steps and held 500 to the end.
    ("anakin", "dqn", "CartPole-v1"): {
        "num_envs": 8, "rollout_len": 16, "updates_per_call": 50, "n_step": 16, "updates_per_rollout": 2,
        "lr": 1e-3, "max_grad_norm": 10.0, "activation": "relu", "target_update_period": 100,
        "epsilon_end": 0.01, "epsilon_decay": 500, "total_steps": 400_000},
    # PQN: the paper's classic-control settings (purejaxql's CartPole: 128x128 relu with
    # layer norm, rewards x0.1, gradients clipped at 10; the learning rate decays, which keeps the end stable).
    ("anakin", "pqn", "CartPole-v1"): {
        "num_envs": 32, "rollout_len": 64, "hidden": (128, 128), "activation": "relu", "lr": 1e-4,
        "max_grad_norm": 10.0, "reward_scale": 0.1, "q_lambda": 0.95,
        "epochs": 4, "minibatches": 16, "total_steps": 250_000},
    # Sebulba: envpool's CartPole on host threads, 24 environments (a count that splits over
    # the learner devices of hosts of 1, 4 and 8 devices; with 32 it reached 500 by about 190k
    # steps). With 120 environments x 32 steps in 8 minibatches it peaked near 320 and fell
    # back to about 120 (one run).
    ("sebulba", "pqn", "CartPole-v1"): {
        "num_envs": 24, "rollout_len": 64, "hidden": (128, 128), "activation": "relu", "lr": 1e-4,
        "max_grad_norm": 10.0, "reward_scale": 0.1, "q_lambda": 0.95, "epochs": 4, "minibatches": 16,
        "total_steps": 250_000, "log_every": 4},
    # Atari (envpool): purejaxql's Atari settings on Nature-CNN, the Q-values layer-normed.
    ("sebulba", "pqn", "Pong-v5"): {
        "num_envs": 24, "rollout_len": 32, "lr": 2.5e-4, "max_grad_norm": 10.0, "q_lambda": 0.65,
        "epsilon_end": 0.001, "epsilon_decay_fraction": 0.1, "epochs": 2, "minibatches": 4,
        "total_steps": 10_000_000, "env_threads": 2},
    # MinAtar (gymnax): purejaxql's settings, observations flattened into the MLP.
    ("anakin", "pqn", "Breakout-MinAtar"): {
        "num_envs": 128, "rollout_len": 32, "hidden": (128, 128), "activation": "relu", "lr": 1e-4,
        "max_grad_norm": 10.0, "q_lambda": 0.65, "epsilon_end": 0.01, "epsilon_decay_fraction": 0.1,
        "epochs": 2, "minibatches": 32, "total_steps": 10_000_000},
    # Gumbel MuZero, 8 simulations a step: few environments and short rollouts, so that each
    # update (128 replayed sequences) follows 32 new steps. The mean return passed 400 after
    # 128k (seed 0) and 168k steps (seed 1), 2.5 to 3 minutes from the command on a shared
    # 2-core CPU, compilation included; runs then held near 500.
    ("anakin", "muzero", "CartPole-v1"): {
        "num_envs": 8, "rollout_len": 4, "updates_per_call": 250, "lr": 1e-3, "max_grad_norm": 5.0,
        "activation": "relu", "anneal_lr": False, "total_steps": 200_000},
    # Sebulba: the same agent, its search on the actor device over envpool's batch.
    ("sebulba", "muzero", "CartPole-v1"): {
        "num_envs": 24, "rollout_len": 4, "lr": 1e-3, "max_grad_norm": 5.0, "activation": "relu",
        "anneal_lr": False, "total_steps": 200_000, "log_every": 50},
    # OpenAI-ES, 64 members: the mean parameters reach 500 within about 15
    # generations; 50 generations take a few seconds after a few seconds' compile.
    ("anakin", "es", "CartPole-v1"): {"generations_per_call": 5, "total_steps": 1_600_000},
    # From about -1,000 to about -200 in 800 generations (10M steps): seconds on a CPU.
    ("anakin", "es", "Pendulum-v1"): {
        "hidden": (32, 32), "generations_per_call": 50, "total_steps": 10_000_000},
    # Sebulba ES: one envpool environment per member episode and per evaluation episode, stepped
    # together. 64 members reach a mean return of 500 in about 8 generations,
    # seconds of training on a 2-core CPU.
    ("sebulba", "es", "CartPole-v1"): {"total_steps": 1_000_000, "log_every": 2},
    # From about -1,200 to about -200 in about 200 generations (2.5M steps).
    ("sebulba", "es", "Pendulum-v1"): {
        "hidden": (32, 32), "total_steps": 4_000_000, "log_every": 20},
}


def preset_for(arch: str, algo: str, env: str) -> dict[str, Any]:
    return dict(PRESETS.get((arch, algo, env), {}))
