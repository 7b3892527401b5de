"""PPO as an agent (`podracer.agent.Agent`): the actor-critic's acting, values and update as pure functions.

IMPALA (`podracer.vtrace.make_agent`) is this agent with its own update: the
two share the network, the acting and the batch they learn from.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from podracer.agent import Agent, Rollout, Trajectory
from podracer.distributions import sampling_noise
from podracer.errors import PodracerError
from podracer.networks import init_params, initial_carry, is_recurrent
from podracer.ppo.update import init_train_state, make_act, make_update as ppo_make_update, policy_inputs
from podracer.types import Transition


def make_agent(network, optimizer: optax.GradientTransformation, config: Any, spec: Any, rollout_len: int,
               axis_names: Sequence[str] = (), make_update: Callable = ppo_make_update, *,
               num_envs: int | None = None) -> Agent:
    """PPO (or, with `make_update`, any update of its signature) on `network` as an `Agent`.

    `network` is an actor-critic (`podracer.networks.make_network`), recurrent
    or not; `spec` the environment's (`obs_shape`, `obs_dtype`, `discrete`,
    `action_dim`). Acting samples the policy from noise drawn ahead of the
    rollout (`distributions.sampling_noise`); `prepare` computes the behaviour
    values of the whole rollout in one batch; `learn` is `make_update`'s update.
    `num_envs` (the environments over every device) is unused: nothing is kept per environment.
    """
    recurrent = is_recurrent(network)
    if recurrent and make_update is not ppo_make_update:
        raise PodracerError("--network=lstm/gru trains with --algo=ppo only; use --network=mlp for this algorithm")
    apply_fn = network.apply
    update = make_update(apply_fn, optimizer, config, axis_names=tuple(axis_names))
    act_fn = make_act(apply_fn, config, presampled=True, recurrent=recurrent)

    def init(key):
        params = init_params(network, spec.obs_shape, spec.obs_dtype, key)
        return init_train_state(params, optimizer, spec.obs_shape)

    def draw(key):
        return sampling_noise(key, spec.discrete, spec.action_dim)

    def act(state, obs, noise, carry):
        if not recurrent:
            # The value is left out (XLA drops the critic from the loop): `prepare`
            # computes it for the whole rollout at once. Called once per step on its
            # own (Sebulba's actors, CartPole's MLP, 120 environments, XLA:CPU inline),
            # this act costs about 48 us of CPU a call against 67 us with the value.
            # (It once measured slower without the value, while the actors drew their
            # noise inside the same call: XLA:CPU then ran the noise and the network
            # on two threads, see `podracer.sebulba.actor.make_acting`.)
            action, log_prob, _ = act_fn(state.params, state.obs_stats, obs, noise)
            return action, carry, log_prob
        no_reset = jnp.zeros(obs.shape[:1], bool)  # the architecture reset `carry` where an episode ended
        action, log_prob, value, carry = act_fn(state.params, state.obs_stats, obs, noise, carry, no_reset)
        return action, carry, (log_prob, value)

    def prepare(state, rollout: Trajectory):
        num_steps, num_envs = rollout.reward.shape
        if recurrent:
            # Values came out of the loop (the core ran there anyway); the values of final
            # observations, with the state that saw them, in one batched step after it.
            def value_of(o, c):  # one step from state c on observations o: [N, ...]
                (_, v), _ = apply_fn(state.params, policy_inputs(o, state.obs_stats, config)[None], c,
                                     jnp.zeros((1, o.shape[0]), bool))
                return v[0]

            log_prob, value = rollout.extras
            flat = lambda x: x.reshape((num_steps * num_envs,) + x.shape[2:])
            final_value = value_of(flat(rollout.final_obs), jax.tree.map(flat, rollout.carry))
            final_value = final_value.reshape(num_steps, num_envs)
            bootstrap_value = value_of(rollout.next_obs, rollout.next_carry)
        else:
            # The behaviour values of every observation acted on, of those that ended
            # truncated episodes and of the next one, each in one batched call: one
            # [T * B] matrix product costs less than T small ones inside the loop.
            value_of = lambda o: apply_fn(state.params, policy_inputs(o, state.obs_stats, config))[1]
            log_prob = rollout.extras
            value, final_value = value_of(rollout.obs), value_of(rollout.final_obs)
            bootstrap_value = value_of(rollout.next_obs)
        batch = Transition(rollout.obs, rollout.action, rollout.reward, rollout.terminated, rollout.truncated,
                           value, log_prob, final_value)
        return batch, bootstrap_value

    def learn(state, batch, bootstrap_value, key, carry):
        return update(state, batch, bootstrap_value, key, *((carry,) if recurrent else ()))

    # Acting reads the parameters and observation statistics; the optimizer state
    # (twice the parameters' size with Adam) stays with the learner.
    return Agent(init, act, prepare, learn, Rollout(rollout_len), draw,
                 lambda num_envs: initial_carry(network, num_envs),
                 acting_state=lambda state: state._replace(opt_state=()))
