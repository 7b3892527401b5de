"""A faithful, compact copy of the well-known single-file JAX recurrent PPO (PureJaxRL's ppo_rnn.py).

Used only as the peer in `bench/recurrent.py`, measured in the same process on
the same machine. Same structure as the original: a 128-unit relu embedding, a
GRU of 128 scanned over time with its state reset where an episode ended
(`ScannedRNN`), 128-unit relu actor and critic heads; one jitted `train` with
nested `lax.scan`s (env steps, GAE, epochs, minibatches of whole environment
sequences replayed from the state at the rollout's start), Adam with linear LR
annealing. Ported only as far as today's flax and gymnax need (gymnax's step
returns `terminated` and `truncated`; the original's `done` is their `or`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen.initializers import constant, orthogonal
from flax.training.train_state import TrainState

REFERENCE_CONFIG = {
    "LR": 2.5e-4, "NUM_ENVS": 4, "NUM_STEPS": 128, "TOTAL_TIMESTEPS": 500_000, "UPDATE_EPOCHS": 4,
    "NUM_MINIBATCHES": 4, "GAMMA": 0.99, "GAE_LAMBDA": 0.95, "CLIP_EPS": 0.2, "ENT_COEF": 0.01,
    "VF_COEF": 0.5, "MAX_GRAD_NORM": 0.5, "ENV_NAME": "CartPole-v1", "ANNEAL_LR": True,
    "GRU_HIDDEN_DIM": 128,
}


class ScannedRNN(nn.Module):
    @functools.partial(nn.scan, variable_broadcast="params", in_axes=0, out_axes=0,
                       split_rngs={"params": False})
    @nn.compact
    def __call__(self, carry, x):
        rnn_state = carry
        ins, resets = x
        rnn_state = jnp.where(resets[:, np.newaxis], self.initialize_carry(ins.shape[0], ins.shape[1]),
                              rnn_state)
        new_rnn_state, y = nn.GRUCell(features=ins.shape[1])(rnn_state, ins)
        return new_rnn_state, y

    @staticmethod
    def initialize_carry(batch_size, hidden_size):
        return nn.GRUCell(features=hidden_size, parent=None).initialize_carry(
            jax.random.PRNGKey(0), (batch_size, hidden_size))


class ActorCriticRNN(nn.Module):
    action_dim: int
    hidden: int

    @nn.compact
    def __call__(self, hidden, x):
        obs, dones = x
        embedding = nn.relu(nn.Dense(self.hidden, kernel_init=orthogonal(np.sqrt(2)),
                                     bias_init=constant(0.0))(obs))
        hidden, embedding = ScannedRNN()(hidden, (embedding, dones))
        actor = nn.relu(nn.Dense(self.hidden, kernel_init=orthogonal(2), bias_init=constant(0.0))(embedding))
        logits = nn.Dense(self.action_dim, kernel_init=orthogonal(0.01), bias_init=constant(0.0))(actor)
        critic = nn.relu(nn.Dense(self.hidden, kernel_init=orthogonal(2), bias_init=constant(0.0))(embedding))
        critic = nn.Dense(1, kernel_init=orthogonal(1.0), bias_init=constant(0.0))(critic)
        return hidden, logits, jnp.squeeze(critic, axis=-1)


class Transition(NamedTuple):
    done: jnp.ndarray
    action: jnp.ndarray
    value: jnp.ndarray
    reward: jnp.ndarray
    log_prob: jnp.ndarray
    obs: jnp.ndarray
    info: jnp.ndarray


def _log_prob(logits, action):
    return jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], -1)[..., 0]


def _entropy(logits):
    p = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.exp(p) * p, -1)


def make_train(config):
    num_updates = config["TOTAL_TIMESTEPS"] // config["NUM_STEPS"] // config["NUM_ENVS"]
    env, env_params = gymnax.make(config["ENV_NAME"])
    hidden_dim = config["GRU_HIDDEN_DIM"]

    def linear_schedule(count):
        frac = 1.0 - (count // (config["NUM_MINIBATCHES"] * config["UPDATE_EPOCHS"])) / num_updates
        return config["LR"] * frac

    def train(rng):
        network = ActorCriticRNN(env.action_space(env_params).n, hidden_dim)
        rng, _rng = jax.random.split(rng)
        obs_shape = env.observation_space(env_params).shape
        init_x = (jnp.zeros((1, config["NUM_ENVS"], *obs_shape)), jnp.zeros((1, config["NUM_ENVS"])))
        init_hstate = ScannedRNN.initialize_carry(config["NUM_ENVS"], hidden_dim)
        params = network.init(_rng, init_hstate, init_x)
        tx = optax.chain(optax.clip_by_global_norm(config["MAX_GRAD_NORM"]),
                         optax.adam(learning_rate=linear_schedule, eps=1e-5))
        train_state = TrainState.create(apply_fn=network.apply, params=params, tx=tx)
        rng, _rng = jax.random.split(rng)
        obsv, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(_rng, config["NUM_ENVS"]), env_params)
        ep_ret = jnp.zeros(config["NUM_ENVS"])

        def _update_step(runner_state, unused):
            def _env_step(runner_state, unused):
                train_state, env_state, last_obs, last_done, hstate, ep_ret, rng = runner_state
                rng, _rng = jax.random.split(rng)
                ac_in = (last_obs[np.newaxis, :], last_done[np.newaxis, :])
                hstate, logits, value = network.apply(train_state.params, hstate, ac_in)
                action = jax.random.categorical(_rng, logits)
                log_prob = _log_prob(logits, action)
                value, action, log_prob = value.squeeze(0), action.squeeze(0), log_prob.squeeze(0)
                rng, _rng = jax.random.split(rng)
                rng_step = jax.random.split(_rng, config["NUM_ENVS"])
                obsv, env_state, reward, terminated, truncated, info = jax.vmap(
                    env.step, in_axes=(0, 0, 0, None))(rng_step, env_state, action, env_params)
                done = jnp.logical_or(terminated, truncated)
                ret = ep_ret + reward
                transition = Transition(last_done, action, value, reward, log_prob, last_obs,
                                        jnp.where(done, ret, jnp.nan))
                runner_state = (train_state, env_state, obsv, done, hstate, jnp.where(done, 0.0, ret), rng)
                return runner_state, transition

            initial_hstate = runner_state[-3]
            runner_state, traj_batch = jax.lax.scan(_env_step, runner_state, None, config["NUM_STEPS"])
            train_state, env_state, last_obs, last_done, hstate, ep_ret, rng = runner_state
            ac_in = (last_obs[np.newaxis, :], last_done[np.newaxis, :])
            _, _, last_val = network.apply(train_state.params, hstate, ac_in)
            last_val = last_val.squeeze(0)

            def _calculate_gae(traj_batch, last_val, last_done):
                def _get_advantages(carry, transition):
                    gae, next_value, next_done = carry
                    done, value, reward = transition.done, transition.value, transition.reward
                    delta = reward + config["GAMMA"] * next_value * (1 - next_done) - value
                    gae = delta + config["GAMMA"] * config["GAE_LAMBDA"] * (1 - next_done) * gae
                    return (gae, value, done), gae

                _, advantages = jax.lax.scan(_get_advantages, (jnp.zeros_like(last_val), last_val, last_done),
                                             traj_batch, reverse=True, unroll=16)
                return advantages, advantages + traj_batch.value

            advantages, targets = _calculate_gae(traj_batch, last_val, last_done)

            def _update_epoch(update_state, unused):
                def _update_minbatch(train_state, batch_info):
                    init_hstate, traj_batch, advantages, targets = batch_info

                    def _loss_fn(params, init_hstate, traj_batch, gae, targets):
                        _, logits, value = network.apply(params, init_hstate[0], (traj_batch.obs, traj_batch.done))
                        log_prob = _log_prob(logits, traj_batch.action)
                        value_pred_clipped = traj_batch.value + (value - traj_batch.value).clip(
                            -config["CLIP_EPS"], config["CLIP_EPS"])
                        value_losses = jnp.square(value - targets)
                        value_losses_clipped = jnp.square(value_pred_clipped - targets)
                        value_loss = 0.5 * jnp.maximum(value_losses, value_losses_clipped).mean()
                        ratio = jnp.exp(log_prob - traj_batch.log_prob)
                        gae = (gae - gae.mean()) / (gae.std() + 1e-8)
                        loss_actor1 = ratio * gae
                        loss_actor2 = jnp.clip(ratio, 1.0 - config["CLIP_EPS"], 1.0 + config["CLIP_EPS"]) * gae
                        loss_actor = -jnp.minimum(loss_actor1, loss_actor2).mean()
                        entropy = _entropy(logits).mean()
                        total_loss = loss_actor + config["VF_COEF"] * value_loss - config["ENT_COEF"] * entropy
                        return total_loss, (value_loss, loss_actor, entropy)

                    grad_fn = jax.value_and_grad(_loss_fn, has_aux=True)
                    total_loss, grads = grad_fn(train_state.params, init_hstate, traj_batch, advantages, targets)
                    return train_state.apply_gradients(grads=grads), total_loss

                train_state, init_hstate, traj_batch, advantages, targets, rng = update_state
                rng, _rng = jax.random.split(rng)
                permutation = jax.random.permutation(_rng, config["NUM_ENVS"])
                batch = (init_hstate, traj_batch, advantages, targets)
                shuffled_batch = jax.tree.map(lambda x: jnp.take(x, permutation, axis=1), batch)
                minibatches = jax.tree.map(
                    lambda x: jnp.swapaxes(jnp.reshape(x, [x.shape[0], config["NUM_MINIBATCHES"], -1]
                                                       + list(x.shape[2:])), 1, 0),
                    shuffled_batch)
                train_state, total_loss = jax.lax.scan(_update_minbatch, train_state, minibatches)
                return (train_state, init_hstate, traj_batch, advantages, targets, rng), total_loss

            init_hstate = initial_hstate[None, :]  # TBH
            update_state = (train_state, init_hstate, traj_batch, advantages, targets, rng)
            update_state, loss_info = jax.lax.scan(_update_epoch, update_state, None, config["UPDATE_EPOCHS"])
            train_state, rng = update_state[0], update_state[-1]
            runner_state = (train_state, env_state, last_obs, last_done, hstate, ep_ret, rng)
            return runner_state, traj_batch.info

        rng, _rng = jax.random.split(rng)
        runner_state = (train_state, env_state, obsv, jnp.zeros(config["NUM_ENVS"], dtype=bool), init_hstate,
                        ep_ret, _rng)
        runner_state, returns = jax.lax.scan(_update_step, runner_state, None, num_updates)
        return {"runner_state": runner_state, "returns": returns}

    return train
