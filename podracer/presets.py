"""Per-environment defaults: what a user gets without tuning anything.

A preset only replaces dataclass defaults; any flag given on the command line
wins over it. Keys are (arch, algo, env id).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[tuple[str, str, str], dict[str, Any]] = {
    # Solves (mean return 500) in about 10 s of training on a 2-core laptop CPU.
    ("anakin", "ppo", "CartPole-v1"): {"num_envs": 32, "rollout_len": 32, "lr": 1e-3},
    # Pendulum needs a short horizon and unclipped, large value targets.
    ("anakin", "ppo", "Pendulum-v1"): {
        "gamma": 0.9, "clip_value": False, "ent_coef": 0.0, "lr": 1e-3, "num_envs": 32,
        "rollout_len": 64, "epochs": 10, "minibatches": 4, "total_steps": 1_000_000},
    # OpenAI-ES, 64 members: the mean parameters reach 500 within about 15
    # generations; 50 generations take a few seconds after a few seconds' compile.
    ("anakin", "es", "CartPole-v1"): {"generations_per_call": 5, "total_steps": 1_600_000},
    # From about -1,000 to about -200 in 800 generations (10M steps): seconds on a CPU.
    ("anakin", "es", "Pendulum-v1"): {
        "hidden": (32, 32), "generations_per_call": 50, "total_steps": 10_000_000},
}


def preset_for(arch: str, algo: str, env: str) -> dict[str, Any]:
    return dict(PRESETS.get((arch, algo, env), {}))
