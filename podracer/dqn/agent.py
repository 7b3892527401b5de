"""DQN as an agent (`podracer.agent.Agent`): epsilon-greedy acting, n-step transitions, a replay buffer in its state.

Each update the architecture hands `learn` a rollout of T steps; `prepare`
cuts it into n-step transitions (`targets.nstep_transitions`), and `learn`
gathers them from every device into the replicated buffer and takes
`updates_per_rollout` gradient steps on sampled minibatches (`update.make_update`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from podracer import replay
from podracer.acting import Policy, keyed_act
from podracer.agent import Agent, Rollout, Trajectory
from podracer.dqn.config import DQNConfig
from podracer.dqn.targets import NStep, nstep_transitions
from podracer.dqn.update import epsilon, init_state, make_update
from podracer.networks import init_params
from podracer.qnetwork import act_epsilon_greedy, make_epsilon_act


def example_transition(spec: Any) -> NStep:
    """One transition of `spec`'s environment (zeros), the shape of the buffer's items."""
    obs = jnp.zeros(spec.obs_shape, spec.obs_dtype)
    return NStep(obs, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), obs)


def make_act(q_fn: Callable) -> Callable:
    """`act(params, obs [N, ...], keys [N], epsilon) -> actions [N]`, epsilon-greedy (0: greedy) among the
    legal actions."""

    def act(params, obs, keys, eps):
        return act_epsilon_greedy(q_fn(params, obs), eps, keys, legal_only=True)

    return act


def make_agent(network, optimizer: optax.GradientTransformation, config: DQNConfig, spec: Any, rollout_len: int,
               axis_names: Sequence[str] = (), *, num_envs: int | None = None) -> Agent:
    """DQN on a Q-network (`podracer.qnetwork.make_q_network`) as an `Agent`, for discrete actions."""
    axes = tuple(axis_names)
    update = make_update(network.apply, optimizer, config, axes)
    act_batch = make_act(network.apply)

    def init(key):
        params = init_params(network, spec.obs_shape, spec.obs_dtype, key)
        return init_state(params, optimizer, config, example_transition(spec))

    def act(state, obs, keys, carry):
        return act_batch(state.params, obs, keys, epsilon(config, state.step)), carry, ()

    def prepare(state, rollout: Trajectory):
        transitions = nstep_transitions(rollout.obs, rollout.action, rollout.reward, rollout.terminated,
                                        rollout.truncated, rollout.final_obs, rollout.next_obs,
                                        config.gamma, config.n_step)
        return transitions, ()

    def learn(state, transitions, bootstrap, key, carry):
        return update(state, replay.gather_rollout(transitions, axes), key)

    # The NaN guard reads what learning computes, not the buffer of what the environments answered.
    return Agent(init, act, prepare, learn, Rollout(rollout_len), draw=lambda key: key,
                 initial_carry=lambda num_envs: (), learned_state=lambda state: state._replace(buffer=()))


def _policy_act_fn(network, config: DQNConfig, deterministic: bool) -> Callable:
    """Greedy, or epsilon-greedy at `epsilon_end`; the log-probability is the epsilon-greedy policy's either way."""
    return make_epsilon_act(network.apply, config.epsilon_end, greedy=deterministic, legal_only=True)


def policy(state, network, config: DQNConfig, deterministic: bool) -> Policy:
    """A trained state's policy, to record a dataset with."""
    return Policy(_policy_act_fn(network, config, deterministic), state.params, "dqn", deterministic)


def load_policy(network, config: DQNConfig, saved: dict, deterministic: bool) -> Callable:
    """`act(obs, key) -> actions` from a checkpoint's agent state (its online network)."""
    return keyed_act(_policy_act_fn(network, config, deterministic), jax.tree.map(jnp.asarray, saved["params"]))
