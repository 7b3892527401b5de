"""Every algorithm the command line trains, as one record each: adding an agent adds one entry here.

An entry names the agent's config section, which architectures run it, how to
build its network and its `Agent` (`podracer.agent`), and how to turn a
trained state back into a policy (to record a dataset, and `load_policy` to
evaluate). The architectures, the command line, populations and evaluation
read these records and never name an algorithm. ES is the exception: an
agent on the contract too (`podracer.es.agent`, which Anakin's one program
builder runs), it searches over parameters instead of learning from
experience, and its drivers (`podracer.anakin.train_es`,
`podracer.sebulba.train_es`) add what its users read: the mean parameters'
return after every call, its log row and summary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from podracer import dqn, muzero, pqn, ppo, sac, vtrace
from podracer.acting import RecurrentPolicy, ppo_policy
from podracer.errors import PodracerError
from podracer.networks import is_recurrent, make_network
from podracer.normalize import RunningStats
from podracer.muzero import policy as muzero_policy
from podracer.ppo.config import PPO_FIX

if TYPE_CHECKING:  # the command line's run spec, built above this layer
    from podracer.orchestrate.spec import RunSpec


class Algorithm(NamedTuple):
    name: str
    """--algo, its config section and the name its recorded datasets carry."""
    config: type
    """Its section's frozen dataclass, with `batch_problem(rollout_len, envs_per_device) -> str | None`."""
    archs: tuple[str, ...]
    """The architectures that run it."""
    make_network: Callable
    """`make_network(spec, network_config) -> network` handed to `make_agent`."""
    make_agent: Callable
    """`make_agent(network, optimizer, config, spec, rollout_len, axis_names, *, num_envs) -> Agent`."""
    optimizer_steps: Callable
    """`optimizer_steps(config) -> int`: optimizer steps per update (for a decaying learning rate)."""
    policy: Callable
    """`policy(state, network, config, deterministic) -> podracer.acting.Policy` of a trained state."""
    load_policy: Callable
    """`load_policy(network, config, saved_state, deterministic) -> act(obs, key)` from a checkpoint's
    agent state (nested dicts of arrays, as restored)."""
    sweepable: tuple[str, ...]
    """Fields of its section a population may vary per agent (besides the optimizer's)."""
    fix: str
    """What the NaN guard suggests."""
    actions: tuple[str, ...] = ("discrete", "continuous")
    """The action spaces it can act in."""
    clones: bool = False
    """Whether `--init-from-dataset` can warm-start it (behaviour cloning of an actor-critic)."""
    settle: Callable | None = None
    """`settle(configs) -> section`: its section completed from the run's other sections once the command
    line is read (PQN: the update count its epsilon schedule spans, from --total-steps)."""

    def check_env(self, spec: Any, env_id: str) -> None:
        """Refuses, in one line, an environment whose actions this algorithm cannot take."""
        kind = "discrete" if spec.discrete else "continuous"
        if kind not in self.actions:
            others = ", ".join(name for name, a in ALGORITHMS.items() if kind in a.actions)
            raise PodracerError(f"--algo={self.name} acts in {' or '.join(self.actions)} action spaces and "
                                f"{env_id} has {kind} actions; use --algo={others.replace(', ', ' or --algo=')} "
                                f"or a {' or '.join(self.actions)}-action environment")


def _actor_critic_network(spec, net):
    return make_network(spec.obs_shape, spec.action_dim, spec.discrete, net.hidden, net.activation,
                        network=net.network, action_mask=spec.action_mask)


def _sac_networks(spec, net):
    return sac.make_networks(spec.obs_shape, spec.action_dim, net.hidden, net.activation, spec.action_low,
                             spec.action_high)


def _actor_critic_policy(name: str) -> Callable:
    def policy(state, network, config, deterministic):
        return ppo_policy(state, network.apply, config, deterministic, name)

    return policy


def _load_actor_critic(network, config, saved, deterministic: bool) -> Callable:

    params = jax.tree.map(jnp.asarray, saved["params"])
    obs_stats = RunningStats(**{k: jnp.asarray(v) for k, v in saved["obs_stats"].items()})
    if is_recurrent(network):
        return RecurrentPolicy(network, ppo.make_act(network.apply, config, deterministic, recurrent=True),
                               params, obs_stats)
    act_batch = ppo.make_act(network.apply, config, deterministic)

    def act(obs: jax.Array, key: jax.Array) -> jax.Array:
        """Actions for a batch of observations [B, ...]."""
        return act_batch(params, obs_stats, obs, jax.random.split(key, obs.shape[0]))[0]

    return act


def _q_network(spec, net):
    return dqn.make_q_network(spec.obs_shape, spec.action_dim, net.hidden, net.activation, spec.action_mask)


_ACTOR_CRITIC_SWEEPABLE = ("ent_coef", "gamma", "vf_coef")
_epochs_times_minibatches = lambda config: config.epochs * config.minibatches

ALGORITHMS: dict[str, Algorithm] = {
    "ppo": Algorithm(
        "ppo", ppo.PPOConfig, ("anakin", "sebulba"), _actor_critic_network, ppo.make_agent,
        _epochs_times_minibatches, _actor_critic_policy("ppo"), _load_actor_critic,
        tuple(sorted(_ACTOR_CRITIC_SWEEPABLE + ("clip_eps", "gae_lambda"))), PPO_FIX, clones=True),
    "impala": Algorithm(
        "impala", vtrace.ImpalaConfig, ("anakin", "sebulba"), _actor_critic_network, vtrace.make_agent,
        _epochs_times_minibatches, _actor_critic_policy("impala"), _load_actor_critic,
        tuple(sorted(_ACTOR_CRITIC_SWEEPABLE + ("c_bar", "pg_rho_bar", "rho_bar", "vtrace_lambda"))),
        vtrace.IMPALA_FIX, clones=True),
    "sac": Algorithm(
        "sac", sac.SACConfig, ("anakin",), _sac_networks, sac.make_agent, lambda config: config.updates_per_rollout,
        sac.policy, sac.load_policy, ("gamma", "tau"), sac.SAC_FIX, actions=("continuous",)),
    "dqn": Algorithm(
        "dqn", dqn.DQNConfig, ("anakin",), _q_network, dqn.make_agent, lambda config: config.updates_per_rollout,
        dqn.policy, dqn.load_policy, ("epsilon_end", "gamma", "tau"), dqn.DQN_FIX, actions=("discrete",)),
    "pqn": Algorithm(
        "pqn", pqn.PQNConfig, ("anakin", "sebulba"), lambda spec, net: pqn.make_q_network(spec, net), pqn.make_agent,
        _epochs_times_minibatches, pqn.policy, pqn.load_policy,
        ("epsilon_decay_fraction", "epsilon_end", "epsilon_start", "gamma", "q_lambda", "reward_scale"),
        pqn.PQN_FIX,
        actions=("discrete",), settle=pqn.with_run_updates),
    "muzero": Algorithm(
        "muzero", muzero.MuZeroConfig, ("anakin", "sebulba"), muzero_policy.make_network, muzero.make_agent,
        lambda config: 1, muzero_policy.policy, muzero_policy.load_policy, ("gamma", "value_coef"),
        muzero.MUZERO_FIX, actions=("discrete",)),
}


def algorithm(configs: RunSpec) -> tuple[Algorithm, Any]:
    """The run's algorithm and its config section."""
    algo = configs.run.algo
    return ALGORITHMS[algo], configs.agent
