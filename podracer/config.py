"""Run-level settings: one frozen dataclass per concern.

Algorithm settings live with their algorithm (`podracer.ppo.PPOConfig`,
`podracer.vtrace.ImpalaConfig`),
architecture settings with their architecture (`podracer.anakin.AnakinConfig`).
Sizes that depend on the devices are derived by pure functions at run time and
never written back into a config.
"""

from __future__ import annotations

import dataclasses

import optax

from podracer.algorithms import ALGORITHMS
from podracer.bounds import NON_NEGATIVE, POSITIVE, SEED, bounded, check_bounds
from podracer.errors import PodracerError

INT32_MAX = 2**31 - 1

ARCHS = ("anakin", "sebulba")
ALGOS = (*ALGORITHMS, "es")
_EVERY_RUN = ("optimizer", "network", "checkpoint", "distributed", "logging", "data")

# The sections each (architecture, algorithm) reads, and the fields of those
# sections it does not: a flag that no section of the pair reads is refused, so
# nothing is silently ignored. Only Anakin runs populations.
USES: dict[tuple[str, str], tuple[str, ...]] = {
    **{(arch, name): ("run", name, arch, *_EVERY_RUN, *(("population",) if arch == "anakin" else ()))
       for name, algo in ALGORITHMS.items() for arch in algo.archs},
    ("anakin", "es"): ("run", "es", "network", "checkpoint", "distributed", "logging", "data", "population"),
    ("sebulba", "es"): ("run", "es", "sebulba", "network", "checkpoint", "distributed", "logging",
                        "data"),
}
# Behaviour cloning fits a PPO actor-critic; an ES run starts from its own initial mean.
_NO_CLONING = {name: "behaviour cloning trains a PPO policy; ES starts from its own mean"
               for name in ("init_from_dataset", "bc_steps", "bc_batch_size", "bc_lr", "bc_value_coef")}
_ES_DATA = {**_NO_CLONING,
            "record_deterministic": "an ES policy acts deterministically: its datasets already are"}
_NOT_AN_ACTOR_CRITIC = {name: "behaviour cloning trains an actor-critic (--algo=ppo or impala)"
                        for name in _NO_CLONING}
IGNORES: dict[tuple[str, str], dict[str, str]] = {
    # field -> why, for fields of a section the pair reads that it has no use for
    **{pair: _NOT_AN_ACTOR_CRITIC for pair in USES if pair[1] in ALGORITHMS and not ALGORITHMS[pair[1]].clones},
    ("anakin", "es"): _ES_DATA,
    ("sebulba", "es"): {
        "num_envs": "the population sets the environments (one per member episode)",
        "rollout_len": "members play whole episodes",
        "async_envs": "members play whole episodes", "synchronous": "generations run in lock step",
        "generations_per_call": "actors and learner meet every generation",
        "horizon": "envpool ends episodes at its own time limit", **_ES_DATA},
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What to run, where its results go."""

    arch: str = "anakin"
    """Architecture: anakin (env and learner on the accelerator) or sebulba (envs on host CPU)."""
    algo: str = "ppo"
    """Algorithm: ppo, impala (V-trace actor-critic), es, or another of `podracer.algorithms.ALGORITHMS`."""
    env: str = "CartPole-v1"
    """Environment id. anakin: gymnax ids (CartPole-v1) or a JAX suite as SUITE:ID (brax:inverted_pendulum, brax:fast, brax:NAME:BACKEND; jumanji:Snake-v1; craftax:Craftax-Classic-Symbolic-v1; navix:Navix-Empty-5x5-v0), each suite an extra: pip install -e ".[brax]" and so on. sebulba: envpool ids (Pong-v5), gymnasium:ID (gymnasium.make_vec) or py:MODULE:FUNCTION (FUNCTION(num_envs) returns a Gymnasium VectorEnv)."""
    seed: int = bounded(0, SEED)
    """Random seed; the same seed and global sizes give the same run on any device count."""
    total_steps: int = bounded(500_000, POSITIVE)
    """Environment steps to train for (over every device), rounded up to what a run trains at once: Anakin's whole calls (--updates-per-call updates of --num-envs x --rollout-len steps; ES: --generations-per-call generations), Sebulba's whole updates or ES generations. The progress line's total is the count trained."""
    run_dir: str = ""
    """Where the run's outputs go (metrics.jsonl, summary.json, tensorboard/, checkpoints/). Default: a new directory runs/ARCH-ALGO-ENV-YYYYmmdd-HHMMSS, and runs/latest links to the newest. A directory that holds a checkpoint RESUMES from it: run the same command with the same --run-dir after a preemption, a crash or Ctrl-C (--total-steps may grow; other settings must match). A finished run's directory is reported and left unchanged. May be gs://BUCKET/PATH (pip install 'podracer-rl[gcs]'; name it yourself, runs/latest is local only)."""
    cpu_devices: int = bounded(0, NON_NEGATIVE)
    """On a CPU-only machine, split the CPU into this many JAX devices. 0: one per core for an Anakin population (--num-seeds, --sweep) or Anakin ES, as many as split its agents or ES pairs evenly (its shares then run side by side); otherwise JAX's default, one."""
    compile_cache: str = ""
    """Where JAX keeps compiled programs, so that a run repeating a program reads it back instead of compiling it: a directory, gs://BUCKET/PATH, or off. Default: $PODRACER_COMPILE_CACHE (a directory or off), else $JAX_COMPILATION_CACHE_DIR, else compile_cache/ beside a gs:// --run-dir, else $XDG_CACHE_HOME/podracer/jax (~/.cache/podracer/jax)."""

    def __post_init__(self):
        check_bounds(self)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Adam with global-norm clipping and an optional linear learning-rate decay."""

    lr: float = bounded(2.5e-4, NON_NEGATIVE)
    """Learning rate."""
    anneal_lr: bool = True
    """Decay the learning rate linearly to zero over the run."""
    max_grad_norm: float = bounded(0.5, POSITIVE)
    """Clip gradients to this global norm."""
    adam_eps: float = bounded(1e-5, POSITIVE)
    """Adam's epsilon."""

    def __post_init__(self):
        check_bounds(self)


@dataclasses.dataclass(frozen=True)
class NetworkConfig:
    """Actor-critic network for vector observations (pixels get Nature-CNN)."""

    hidden: tuple[int, ...] = bounded((64, 64), POSITIVE)
    """Hidden layer widths of the actor and the critic MLPs."""
    activation: str = "tanh"
    """Hidden activation: tanh or relu."""
    network: str = "mlp"
    """mlp (feed-forward), or lstm / gru: a recurrent core for tasks that need memory (PPO only). Its state is carried through the rollout, zeroed where an episode ends, and each update replays whole environment sequences from the state stored at their start (minibatches split environments: --num-envs per device must divide by --minibatches)."""

    def __post_init__(self):
        if self.network not in ("mlp", "lstm", "gru"):
            raise ValueError(f"--network must be mlp, lstm or gru, got {self.network!r}")
        if self.activation not in ("tanh", "relu"):
            raise ValueError(f"--activation must be tanh or relu, got {self.activation!r}")
        if not self.hidden:
            raise ValueError("--hidden needs at least one width")
        check_bounds(self)


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Where metrics go besides metrics.jsonl and TensorBoard."""

    wandb: bool = False
    """Also log every metrics row to Weights & Biases, on every architecture and algorithm (needs `pip install wandb` and a login, or WANDB_MODE=offline); its files go to RUN_DIR/wandb."""
    wandb_project: str = "podracer"
    """Weights & Biases project name."""
    profile: bool = False
    """Attribute the run's wall time to named operations (a table, also in summary.json) and write a jax.profiler trace to RUN_DIR/profile; Anakin then runs its phases as separate programs."""
    profile_trace_s: float = bounded(5.0, NON_NEGATIVE)
    """With --profile: seconds of training the trace covers (the time table covers the whole run; on CPU a trace grows by tens of MB a second); 0 for no trace."""

    def __post_init__(self):
        check_bounds(self)


def make_optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The optax chain for `config`; `total_steps` optimiser steps for the decay.

    Clipping and Adam run on the parameters' own arrays. (Wrapping the chain in
    `optax.flatten`, one vector for all of them, measured slower: a quarter of
    PQN's update on Breakout-MinAtar on a 2-core CPU, and no faster for PPO or
    SAC.) optax counts the steps in an int32, so a run of more is refused here,
    before anything compiles.
    """
    if total_steps > INT32_MAX:
        raise PodracerError(f"--total-steps asks for {total_steps:,} optimizer steps, more than the "
                            f"{INT32_MAX:,} an optimizer's int32 step counter holds; lower --total-steps")
    lr = optax.linear_schedule(config.lr, 0.0, max(1, total_steps)) if config.anneal_lr else config.lr
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr, eps=config.adam_eps))
