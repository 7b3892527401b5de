"""Actor-critic networks: an MLP for vector observations, Nature-CNN for pixels, LSTM/GRU for memory.

Every feed-forward actor-critic maps a batch of observations to `(distribution,
value)`, which is the `apply_fn` contract used by PPO, the actors and
`load_policy`. A recurrent one (`RecurrentActorCritic`, `--network=lstm|gru`)
maps time-major sequences and the carry they start from to
`((distribution, value), carry)` (see its docstring). Evolution strategies use
`make_policy_network` instead: a deterministic policy, no critic.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from podracer.distributions import Categorical, DiagGaussian, masked_logits

ACTIVATIONS: dict[str, Callable] = {"tanh": nn.tanh, "relu": nn.relu}


def _kernel_gradient(x, g):
    """`x^T g` over the flattened batch: the gradient of `x @ kernel`'s kernel.

    XLA:CPU gives a dot to its fast library (YNNPACK) only when the left operand
    contracts its minor dimension; `x^T g` contracts the batch, so XLA folds the
    transpose into the dot and runs it on a slower generic path (a 64x64 kernel's
    gradient from 128 samples: 7.5 us against 6.6 us, a 64x2 one 3.2 us against
    2.0). On CPU the barrier keeps the transpose a copy of its own, which is cheap.
    """
    x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])

    def cpu(x, g):
        return lax.optimization_barrier(x.T) @ g

    return lax.platform_dependent(x, g, cpu=cpu, default=lambda x, g: x.T @ g)


@jax.custom_vjp
def _matmul(x, kernel):
    return x @ kernel


def _matmul_fwd(x, kernel):
    return x @ kernel, (x, kernel)


def _matmul_bwd(residuals, g):
    x, kernel = residuals
    return g @ kernel.T, _kernel_gradient(x, g)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _dot_general(x, kernel, dimension_numbers, precision=None):
    """What `nn.Dense` contracts (`x`'s last axis with `kernel`'s first), through `_matmul`."""
    assert dimension_numbers == (((x.ndim - 1,), (0,)), ((), ())), dimension_numbers
    return _matmul(x, kernel)


def dense(features: int, scale: float) -> nn.Dense:
    """`nn.Dense` with an orthogonal kernel of gain `scale`, zero bias, and `_matmul`'s CPU-friendly gradient."""
    return nn.Dense(features, kernel_init=nn.initializers.orthogonal(scale),
                    bias_init=nn.initializers.zeros, dot_general=_dot_general)


class MLP(nn.Module):
    hidden: Sequence[int]
    activation: str = "tanh"

    @nn.compact
    def __call__(self, x):
        act = ACTIVATIONS[self.activation]
        for width in self.hidden:
            x = act(dense(width, np.sqrt(2))(x))
        return x


class PolicyHead(nn.Module):
    """Categorical logits for `num_actions`, or a state-independent-std Gaussian."""

    action_dim: int
    discrete: bool

    @nn.compact
    def __call__(self, x, legal=None):
        out = dense(self.action_dim, 0.01)(x)
        if self.discrete:
            return Categorical(logits=out if legal is None else masked_logits(out, legal))
        log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
        return DiagGaussian(mean=out, log_std=jnp.broadcast_to(log_std, out.shape))


class MLPActorCritic(nn.Module):
    """Separate actor and critic MLPs (sharing hurts on small control tasks)."""

    action_dim: int
    discrete: bool
    hidden: Sequence[int] = (64, 64)
    activation: str = "tanh"
    obs_rank: int = 1  # trailing observation dimensions, flattened before the MLP
    action_mask: bool = False  # the last `action_dim` inputs are the legal actions (0/1)

    @nn.compact
    def __call__(self, obs):
        x, legal = split_mask(obs, self.obs_rank, self.action_dim if self.action_mask else 0)
        dist = PolicyHead(self.action_dim, self.discrete)(MLP(self.hidden, self.activation)(x), legal)
        value = dense(1, 1.0)(MLP(self.hidden, self.activation)(x))[..., 0]
        return dist, value


def split_mask(obs, obs_rank: int, mask_dim: int):
    """Flattened float features, and the legal-action mask from the last `mask_dim` of them (or None)."""
    x = obs.reshape(obs.shape[: obs.ndim - obs_rank] + (-1,)).astype(jnp.float32)
    if not mask_dim:
        return x, None
    return x[..., :-mask_dim], x[..., -mask_dim:] > 0.5


class NatureCNN(nn.Module):
    """The DQN torso (Mnih et al. 2015) on [..., H, W, C] or [..., C, H, W] uint8 frames."""

    channels_last: bool = False

    @nn.compact
    def __call__(self, frames):
        x = frames.astype(jnp.float32) / 255.0
        if not self.channels_last:  # envpool yields [C, H, W]
            x = jnp.moveaxis(x, -3, -1)
        for features, kernel, stride in ((32, 8, 4), (64, 4, 2), (64, 3, 1)):
            x = nn.relu(nn.Conv(features, (kernel, kernel), (stride, stride), padding="VALID",
                                kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        x = x.reshape(x.shape[:-3] + (-1,))
        return nn.relu(dense(512, np.sqrt(2))(x))


class CNNActorCritic(nn.Module):
    """Nature-CNN torso shared by a categorical policy head and a value head."""

    action_dim: int
    channels_last: bool = False

    @nn.compact
    def __call__(self, frames):
        hidden = NatureCNN(self.channels_last)(frames)
        dist = PolicyHead(self.action_dim, discrete=True)(hidden)
        value = dense(1, 1.0)(hidden)[..., 0]
        return dist, value


NETWORKS = ("mlp", "lstm", "gru")  # --network: feed-forward, or a recurrent core
CELLS: dict[str, Callable] = {"lstm": nn.OptimizedLSTMCell, "gru": nn.GRUCell}


class _Core(nn.Module):
    """One recurrent step on [B, ...] inputs: the carry is zeroed where `reset`, then the cell runs."""

    cell: str
    features: int

    @nn.compact
    def __call__(self, carry, inputs):
        x, reset = inputs
        carry = reset_carry(carry, reset)
        return CELLS[self.cell](self.features)(carry, x)


class RecurrentActorCritic(nn.Module):
    """A torso, an LSTM or GRU core shared by actor and critic, and an MLP head for each.

    `apply(params, obs, carry, reset) -> ((distribution, value), carry)` on
    time-major sequences: `obs` [T, B, ...], `reset` [T, B] (True where an
    episode starts at that step: the carry is zeroed before the step), `carry`
    the state before step 0 (`initial_carry`) and the result the state after
    step T-1. Acting is a sequence of one step (`T = 1`), so the rollout and the
    update run the same function. The torso is a dense layer of `hidden[0]`
    units (Nature-CNN for frames, with a 512-unit core); the heads are MLPs of
    `hidden[1:]`. Torso and heads run on all T x B inputs at once; only the core
    steps through time.
    """

    action_dim: int
    discrete: bool
    hidden: Sequence[int] = (64, 64)
    activation: str = "tanh"
    obs_rank: int = 1
    cell: str = "lstm"
    cnn: bool = False
    channels_last: bool = False

    @property
    def core_size(self) -> int:
        return 512 if self.cnn else self.hidden[0]

    @nn.compact
    def __call__(self, obs, carry, reset):
        lead = obs.shape[:2]
        if self.cnn:
            x = NatureCNN(self.channels_last)(obs)
        else:
            x = obs.reshape(lead + (-1,)).astype(jnp.float32)
            x = ACTIVATIONS[self.activation](dense(self.hidden[0], np.sqrt(2))(x))
        core = nn.scan(_Core, variable_broadcast="params", split_rngs={"params": False})
        carry, h = core(self.cell, self.core_size, name="core")(carry, (x, reset))
        dist = PolicyHead(self.action_dim, self.discrete)(MLP(self.hidden[1:], self.activation)(h))
        value = dense(1, 1.0)(MLP(self.hidden[1:], self.activation)(h))[..., 0]
        return (dist, value), carry


def is_recurrent(network) -> bool:
    return isinstance(network, RecurrentActorCritic)


def initial_carry(network, batch_size: int):
    """The carry a fresh episode starts from ([B, core] zeros); `()` for a feed-forward network."""
    if not is_recurrent(network):
        return ()
    zeros = jnp.zeros((batch_size, network.core_size), jnp.float32)
    return (zeros, zeros) if network.cell == "lstm" else zeros


def reset_carry(carry, reset: jax.Array):
    """`carry` with the rows where `reset` ([B] bool) zeroed: a fresh episode's state."""
    return jax.tree.map(lambda c: jnp.where(reset.reshape(reset.shape + (1,) * (c.ndim - 1)),
                                            jnp.zeros_like(c), c), carry)


def make_network(obs_shape: Sequence[int], action_dim: int, discrete: bool,
                 hidden: Sequence[int] = (64, 64), activation: str = "tanh",
                 network: str = "mlp", action_mask: bool = False) -> nn.Module:
    """Nature-CNN for frames big enough for its 8x8/4 first layer, an MLP otherwise.

    Frames are channels-first ([C, H, W], envpool's layout) when the leading
    dimension is the smallest, channels-last ([H, W, C]) otherwise. `network`
    `lstm` or `gru` puts a recurrent core after that torso (`RecurrentActorCritic`).
    With `action_mask` (a flat observation whose last `action_dim` entries are the
    legal actions), the MLP masks the policy's logits.
    """
    if network not in NETWORKS:
        raise ValueError(f"--network must be one of {', '.join(NETWORKS)}, got {network!r}")
    if action_mask:
        if network != "mlp":
            raise ValueError(f"--network={network} does not read an environment's action mask; "
                             "use --network=mlp for this environment")
        return MLPActorCritic(action_dim, discrete, tuple(hidden), activation, len(obs_shape), True)
    cnn, channels_last = False, False
    if len(obs_shape) == 3 and discrete:
        channels_last = obs_shape[-1] <= obs_shape[0]
        spatial = obs_shape[:2] if channels_last else obs_shape[1:]
        cnn = min(spatial) >= 36
    if network != "mlp":
        return RecurrentActorCritic(action_dim, discrete, tuple(hidden), activation, len(obs_shape),
                                    network, cnn, channels_last)
    if cnn:
        return CNNActorCritic(action_dim, channels_last=channels_last)
    return MLPActorCritic(action_dim, discrete, tuple(hidden), activation, len(obs_shape))


class MLPPolicy(nn.Module):
    """Deterministic policy for evolution strategies: observation -> action.

    The actor MLP and head of `MLPActorCritic` without the critic, whose
    parameters ES would only perturb for nothing. Discrete actions are the argmax
    of the logits; continuous actions are the head's output, which the
    environment clips to its bounds (the mode of the PPO policy's Gaussian).
    """

    action_dim: int
    discrete: bool
    hidden: Sequence[int] = (64, 64)
    activation: str = "tanh"
    obs_rank: int = 1
    action_mask: bool = False  # as MLPActorCritic's: the argmax is over legal actions only

    @nn.compact
    def __call__(self, obs):
        x, legal = split_mask(obs, self.obs_rank, self.action_dim if self.action_mask else 0)
        out = dense(self.action_dim, 0.01)(MLP(self.hidden, self.activation)(x))
        if legal is not None:
            out = masked_logits(out, legal)
        return jnp.argmax(out, axis=-1) if self.discrete else out


def make_policy_network(obs_shape: Sequence[int], action_dim: int, discrete: bool,
                        hidden: Sequence[int] = (64, 64), activation: str = "tanh",
                        action_mask: bool = False) -> nn.Module:
    """`MLPPolicy` for any observation shape (frames are flattened)."""
    return MLPPolicy(action_dim, discrete, tuple(hidden), activation, len(obs_shape), action_mask)


def init_params(network: nn.Module, obs_shape: Sequence[int], obs_dtype, key: jax.Array):
    """Parameters for `network`, initialised from a single dummy observation."""
    obs = jnp.zeros((1, *obs_shape), obs_dtype)
    if is_recurrent(network):
        return network.init(key, obs[None], initial_carry(network, 1), jnp.zeros((1, 1), bool))
    return network.init(key, obs)


def _pair_product(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """`x @ kernel` for a pair's two rows; narrow outputs as products summed along the rows.

    Under a vmap over pairs this is a batched matrix product with a kernel per
    pair: XLA:CPU runs one with a few output columns (a policy head) slowly, a
    product summed along the contiguous input axis in one fused kernel
    (128 pairs, 64 -> 2: 19 us against 7).
    """
    if isinstance(kernel, tuple):  # low rank: kernel = a @ b.T, a [m, r], b [n, r]
        a, b = kernel
        rank = a.shape[-1]
        # [..., r], then r outer products; XLA:CPU is erratic on these small shapes
        # (measured per rank: a dot for r = 1, products summed along the rows above).
        xa = x @ a if rank == 1 else jnp.sum(x[..., None, :] * a.T, axis=-1)
        return functools.reduce(jnp.add, [xa[..., j:j + 1] * b[:, j] for j in range(rank)])
    if kernel.shape[-1] > 8:
        return x @ kernel
    return jnp.sum(x[..., None, :] * kernel.T, axis=-1)


def apply_antithetic(module: nn.Module, mean, noise, scale, obs: jax.Array) -> jax.Array:
    """`module.apply` for both members of an antithetic pair, sharing their work.

    Row 0 of `obs` ([2, ...]) is acted on with the variables `mean + scale *
    noise`, row 1 with `mean - scale * noise` (`mean` and `noise` are variable
    trees of `module`; a kernel's noise may be a pair of factors `(a, b)`
    standing for `a @ b.T`, as low-rank ES draws it). Each `nn.Dense` computes,
    for rows `x` and signs `s`,

        x @ W + b + s * scale * (x @ dW + db)

    instead of building two kernels: one product with the mean's kernel for
    both rows, one with the noise for the pair. For a population that is every
    member sharing one matrix product per layer, and one per pair for the noise,
    where a member-by-member evaluation reads a kernel per member. The same
    numbers up to rounding. Only for modules whose parameters all belong to
    `nn.Dense` layers (checked when traced).
    """
    used = set()

    def paired_dense(next_fun, args, kwargs, context):
        layer = context.module
        if not (isinstance(layer, nn.Dense) and context.method_name == "__call__"):
            return next_fun(*args, **kwargs)
        (x,) = args
        path = tuple(layer.scope.path)
        used.add(path)
        layer_noise = noise["params"]
        for name in path:
            layer_noise = layer_noise[name]
        sign = jnp.array([1.0, -1.0], x.dtype).reshape((2,) + (1,) * (x.ndim - 1))
        kernel = layer.get_variable("params", "kernel")
        y = x @ kernel + sign * (scale * _pair_product(x, layer_noise["kernel"]))
        if layer.use_bias:
            y = y + layer.get_variable("params", "bias") + sign * (scale * layer_noise["bias"])
        return y

    with nn.intercept_methods(paired_dense):
        out = module.apply(mean, obs)
    owners = {tuple(str(k.key) for k in path[:-1])
              for path, _ in jax.tree_util.tree_flatten_with_path(mean["params"])[0]}
    if owners - used:
        raise ValueError(f"apply_antithetic handles nn.Dense parameters only; {module.__class__.__name__} "
                         f"has others at {sorted(owners - used)}")
    return out
