"""The replay buffer in an agent's state: every device adds the same global rows and draws the same batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from podracer import replay
from podracer.errors import PodracerError
from podracer.protocol import parallel


def _on_devices(fn, num_devices, *args, in_specs, out_specs):
    mesh = parallel.make_mesh(jax.devices()[:num_devices])
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))(*args)


def test_every_device_adds_the_global_rollout_in_environment_order():
    rows = jnp.arange(3 * 8, dtype=jnp.float32).reshape(3, 8)  # [T, B]: row t, environment b
    axes = (parallel.DATA_AXIS,)
    gathered = _on_devices(lambda r: replay.gather_rollout(r, axes)[None], 4, rows,
                           in_specs=(P(None, parallel.DATA_AXIS),), out_specs=P(parallel.DATA_AXIS))
    assert gathered.shape == (4, 24)
    for device_rows in np.asarray(gathered):  # each device holds all of it, time-major
        np.testing.assert_array_equal(device_rows, np.asarray(rows).reshape(-1))


def test_device_shares_of_a_batch_make_the_batch():
    batch = jnp.arange(16.0)
    axes = (parallel.DATA_AXIS,)
    shares = _on_devices(lambda b: replay.device_share(b, axes), 4, batch, in_specs=(P(),),
                         out_specs=P(parallel.DATA_AXIS))
    np.testing.assert_array_equal(np.asarray(shares), np.asarray(batch))
    assert replay.device_share(batch, ()) is batch


def test_the_buffer_samples_only_once_it_holds_a_batch():
    buffer = replay.make_buffer(capacity=32, batch_size=8, min_size=4)
    state = buffer.init({"x": jnp.zeros(2)})
    state = buffer.add(state, {"x": jnp.ones((5, 2))})
    assert not replay.ready(buffer, state)
    state = buffer.add(state, {"x": jnp.ones((5, 2))})
    assert replay.ready(buffer, state)
    assert buffer.sample(state, jax.random.key(0)).experience["x"].shape == (8, 2)


@pytest.mark.parametrize("capacity, batch, start, words", [
    (4, 8, 0, "smaller than one batch"), (16, 8, 32, "never fit")])
def test_a_buffer_that_cannot_serve_a_batch_is_refused(capacity, batch, start, words):
    with pytest.raises(PodracerError, match=words):
        replay.make_buffer(capacity, batch, start)
    assert "multiple of 4" in replay.share_problem(6, 4) and replay.share_problem(8, 4) is None


def test_every_device_adds_each_environments_history_and_samples_consecutive_windows():
    rows = jnp.arange(3 * 8, dtype=jnp.float32).reshape(3, 8)  # [T, B]: row t, environment b: 8 t + b
    axes = (parallel.DATA_AXIS,)
    gathered = _on_devices(lambda r: replay.gather_sequences(r, axes)[None], 4, rows,
                           in_specs=(P(None, parallel.DATA_AXIS),), out_specs=P(parallel.DATA_AXIS))
    for device_rows in np.asarray(gathered):  # each device holds every environment's history, batch-major
        np.testing.assert_array_equal(device_rows, np.asarray(rows).T)

    buffer = replay.make_sequence_buffer(num_envs=8, capacity=80, batch_size=16, sequence_len=4, min_size=32)
    state = buffer.init(jnp.zeros(()))
    for start in (0, 3):
        assert not replay.ready(buffer, state)
        state = buffer.add(state, rows.T + 8 * start)  # steps 0-2, then 3-5 of every environment
    assert replay.ready(buffer, state)
    windows = np.asarray(buffer.sample(state, jax.random.key(0)).experience)
    assert windows.shape == (16, 4)
    np.testing.assert_array_equal(np.diff(windows, axis=1), 8)  # consecutive steps of one environment
    with pytest.raises(PodracerError, match="fewer than one replayed sequence"):
        replay.make_sequence_buffer(num_envs=8, capacity=24, batch_size=4, sequence_len=4, min_size=0)
