"""Episodes as batched arrays: padded batches, windows of steps, flat transitions.

Everything here is plain numpy on the host (episodes have different lengths);
move a result to devices with `jax.device_put`. An episode is a dict
`{"steps": {field: [L, ...]}, **metadata}`; `steps` may nest (an observation that
is itself a dict of arrays).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from podracer.bc import Demonstrations
from podracer.data.spec import ACTION, DISCOUNT, IS_LAST, OBSERVATION, REWARD, STEPS


class EpisodeBatch(NamedTuple):
    """N episodes padded to a common length L.

    `steps` holds [N, L, ...] arrays (a nested dict, as in the dataset), zero past
    each episode's end; `mask` [N, L] is True on real steps; `metadata` holds
    [N, ...] arrays of the per-episode fields.
    """

    steps: dict
    mask: Any
    metadata: dict


def episode_length(steps: Mapping) -> int:
    """Number of steps (transitions + 1) of one episode's `steps` dict."""
    return int(np.shape(jax.tree.leaves(steps)[0])[0])


def pad_episodes(episodes: Sequence[Mapping], length: int | None = None) -> EpisodeBatch:
    """Stack episodes into an `EpisodeBatch`, zero-padded to `length` (default: the longest)."""
    if not episodes:
        raise ValueError("no episodes to batch")
    lengths = np.array([episode_length(episode[STEPS]) for episode in episodes])
    length = int(lengths.max()) if length is None else length
    if lengths.max() > length:
        raise ValueError(f"an episode has {lengths.max()} steps, more than length={length}")

    def pad(x):
        x = np.asarray(x)
        return np.pad(x, [(0, length - x.shape[0])] + [(0, 0)] * (x.ndim - 1))

    steps = jax.tree.map(lambda *xs: np.stack([pad(x) for x in xs]), *[e[STEPS] for e in episodes])
    metadata = {key: np.stack([np.asarray(e[key]) for e in episodes])
                for key in episodes[0] if key != STEPS}
    mask = np.arange(length)[None, :] < lengths[:, None]
    return EpisodeBatch(steps, mask, metadata)


def unpad_episodes(batch: EpisodeBatch) -> list[dict]:
    """The episodes of a batch, each cut to its own length: the inverse of `pad_episodes`."""
    batch = jax.device_get(batch)
    lengths = np.asarray(batch.mask).sum(axis=1)
    return [{STEPS: jax.tree.map(lambda x, i=i, n=n: np.asarray(x[i, :n]), batch.steps),
             **{key: np.asarray(value[i]) for key, value in batch.metadata.items()}}
            for i, n in enumerate(lengths)]


def windows(batch: EpisodeBatch, size: int, stride: int = 1) -> dict:
    """Every run of `size` consecutive steps inside one episode, as [M, size, ...] arrays.

    Windows start every `stride` steps and never cross an episode boundary or
    reach into padding. The last step of an episode carries only its observation
    (see `podracer.data.spec`); a window that contains it has `is_last` set there.
    """
    if size <= 0 or stride <= 0:
        raise ValueError(f"window size and stride must be positive, got {size} and {stride}")
    lengths = np.asarray(batch.mask).sum(axis=1)
    starts = [(episode, start) for episode, n in enumerate(lengths)
              for start in range(0, int(n) - size + 1, stride)]
    episode_index = np.array([e for e, _ in starts], np.int64).reshape(-1, 1)
    step_index = np.array([s for _, s in starts], np.int64).reshape(-1, 1) + np.arange(size)
    return jax.tree.map(lambda x: np.asarray(x)[episode_index, step_index], batch.steps)


def returns_to_go(reward, discount, mask, gamma: float) -> np.ndarray:
    """G_t = r_t + gamma * d_t * G_{t+1} over [N, L] arrays, zero past each episode's end.

    The sum stops at the end of the recorded episode: a truncated episode is not
    bootstrapped (there is no value estimate to bootstrap from).
    """
    reward = np.where(mask, np.asarray(reward, np.float32), 0.0)
    discount = np.where(mask, np.asarray(discount, np.float32), 0.0)
    out = np.zeros_like(reward)
    following = np.zeros(reward.shape[0], np.float32)
    for t in reversed(range(reward.shape[1])):
        following = reward[:, t] + gamma * discount[:, t] * following
        out[:, t] = following
    return out


def demonstrations(batch: EpisodeBatch, gamma: float = 0.99) -> Demonstrations:
    """The (observation, action, discounted return-to-go) of every acting step, flat.

    Every step but an episode's last acts; the return uses the dataset's `reward`
    and `discount` when it has them (zero returns otherwise).
    """
    steps = batch.steps
    mask = np.asarray(batch.mask)
    acting = mask & ~np.asarray(steps[IS_LAST], bool)
    if REWARD in steps:
        discount = steps[DISCOUNT] if DISCOUNT in steps else np.ones(mask.shape, np.float32)
        # The last step's reward and discount are not meaningful: leave them out.
        target = returns_to_go(steps[REWARD], discount, acting, gamma)
    else:
        target = np.zeros(mask.shape, np.float32)
    take = lambda x: np.asarray(x)[acting]
    return Demonstrations(jax.tree.map(take, steps[OBSERVATION]), take(steps[ACTION]), take(target))
