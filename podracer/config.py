"""Run-level settings: one frozen dataclass per concern.

Algorithm settings live with their algorithm (`podracer.ppo.PPOConfig`),
architecture settings with their architecture (`podracer.anakin.AnakinConfig`).
Sizes that depend on the devices are derived by pure functions at run time and
never written back into a config.
"""

from __future__ import annotations

import dataclasses

import optax

ARCHS = ("anakin", "sebulba")
ALGOS = ("ppo", "es")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What to run, where its results go."""

    arch: str = "anakin"
    """Architecture: anakin (env and learner on the accelerator) or sebulba (envs on host CPU)."""
    algo: str = "ppo"
    """Algorithm: ppo or es."""
    env: str = "CartPole-v1"
    """Environment id (gymnax ids for anakin, envpool ids for sebulba)."""
    seed: int = 0
    """Random seed; the same seed and global sizes give the same run on any device count."""
    total_steps: int = 500_000
    """Environment steps to train for (over every device)."""
    run_dir: str = "runs/latest"
    """Directory for metrics.jsonl and summary.json."""
    cpu_devices: int = 0
    """On a CPU-only machine, split the CPU into this many JAX devices (0: JAX's default)."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Adam with global-norm clipping and an optional linear learning-rate decay."""

    lr: float = 2.5e-4
    """Learning rate."""
    anneal_lr: bool = True
    """Decay the learning rate linearly to zero over the run."""
    max_grad_norm: float = 0.5
    """Clip gradients to this global norm."""
    adam_eps: float = 1e-5
    """Adam's epsilon."""

    def __post_init__(self):
        if self.lr < 0 or self.max_grad_norm <= 0 or self.adam_eps <= 0:
            raise ValueError("--lr must be >= 0, --max-grad-norm and --adam-eps > 0")


@dataclasses.dataclass(frozen=True)
class NetworkConfig:
    """Actor-critic network for vector observations (pixels get Nature-CNN)."""

    hidden: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the actor and the critic MLPs."""
    activation: str = "tanh"
    """Hidden activation: tanh or relu."""

    def __post_init__(self):
        if self.activation not in ("tanh", "relu"):
            raise ValueError(f"--activation must be tanh or relu, got {self.activation!r}")
        if not self.hidden or min(self.hidden) <= 0:
            raise ValueError(f"--hidden needs positive widths, got {self.hidden}")


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Where metrics go besides metrics.jsonl and TensorBoard."""

    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb` and a login)."""
    wandb_project: str = "podracer"
    """Weights & Biases project name."""
    profile: bool = False
    """Attribute the run's wall time to named operations (a table, also in summary.json) and write a jax.profiler trace to RUN_DIR/profile; Anakin then runs its phases as separate programs."""
    profile_trace_s: float = 5.0
    """With --profile: seconds of training the trace covers (the time table covers the whole run; on CPU a trace grows by tens of MB a second); 0 for no trace."""

    def __post_init__(self):
        if self.profile_trace_s < 0:
            raise ValueError(f"--profile-trace-s must be >= 0, got {self.profile_trace_s}")


def make_optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The optax chain for `config`; `total_steps` optimiser steps for the decay.

    Wrapped in `optax.flatten` so clipping and Adam run on one vector rather than
    one small array per layer: fewer, larger kernels on every backend.
    """
    lr = optax.linear_schedule(config.lr, 0.0, max(1, total_steps)) if config.anneal_lr else config.lr
    return optax.flatten(optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                                     optax.adam(lr, eps=config.adam_eps)))
