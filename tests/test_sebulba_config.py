"""Device splits and sizes: defaults per machine, and one-line errors for bad splits."""

import json
import subprocess

import jax
import pytest

from conftest import LAUNCHER, PYTHON
from podracer.errors import PodracerError
from podracer.ppo import PPOConfig
from podracer.sebulba.config import SebulbaConfig, make_layout, split_devices


def _split(devices, **flags):
    split = split_devices(SebulbaConfig(**flags), devices)
    return [d.id for d in split.actor], [d.id for d in split.learner]


def test_default_splits():
    devices = jax.devices()
    assert _split(devices[:1]) == ([0], [0])  # one device: actors and learner share it
    assert _split(devices[:4]) == ([0], [1, 2, 3])
    # A quarter act: on an 8-chip TPU host (v6e-8) 2 and 6, never 7 learners.
    assert _split(devices) == ([0, 1], [2, 3, 4, 5, 6, 7])


def test_given_splits_and_their_complements():
    devices = jax.devices()[:4]
    assert _split(devices, actor_devices=(0, 1), learner_devices=(2, 3)) == ([0, 1], [2, 3])
    assert _split(devices, actor_devices=(3,)) == ([3], [0, 1, 2])
    assert _split(devices, learner_devices=(0, 1)) == ([2], [0, 1])
    assert _split(devices[:1], learner_devices=(0,)) == ([0], [0])


@pytest.mark.parametrize("flags, message", [
    (dict(actor_devices=(0,), learner_devices=(0, 1)), "device 0 is in both"),
    (dict(actor_devices=(4,)), "index 4 is out of range"),
    (dict(learner_devices=(-1,)), "index -1 is out of range"),
    (dict(learner_devices=(1, 1)), "lists a device twice"),
])
def test_bad_splits_are_one_line_errors(flags, message):
    with pytest.raises(PodracerError, match=message) as error:
        split_devices(SebulbaConfig(**flags), jax.devices()[:4])
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("flags, message", [
    (dict(num_envs=30, actor_threads=4), "does not split over 4 actor threads"),
    (dict(num_envs=8, actor_threads=2), "do not split over 3 learner devices"),
    (dict(num_envs=9, async_envs=True), "even number per thread"),
    (dict(num_envs=6, rollout_len=30), "does not split into --minibatches=4"),
])
def test_bad_sizes_are_one_line_errors(flags, message):
    split = split_devices(SebulbaConfig(), jax.devices()[:4])
    with pytest.raises(PodracerError, match=message):
        make_layout(SebulbaConfig(**flags), PPOConfig(), split)


def test_sizes_out_of_their_range_are_refused_by_the_config():
    with pytest.raises(ValueError, match="--actor-threads must be > 0, got 0"):
        SebulbaConfig(actor_threads=0)


def test_layout_sizes():
    config = SebulbaConfig(num_envs=24, rollout_len=16, actor_threads=2, async_envs=True)
    layout = make_layout(config, PPOConfig(), split_devices(config, jax.devices()[:4]))
    assert layout == (2, 12, 6, 24 * 16)


@pytest.mark.parametrize("args", [
    ["--actor-devices", "0", "--learner-devices", "0", "1"],
    ["--learner-devices", "9"],
    ["--num-envs=6", "--actor-threads=4"],
], ids=["overlapping", "out of range", "envs over threads"])
def test_launcher_rejects_bad_splits_with_exit_2(args, tmp_path):
    result = subprocess.run(
        [PYTHON, LAUNCHER, "--arch=sebulba", "--cpu-devices=4", f"--run-dir={tmp_path / 'run'}", *args],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not (tmp_path / "run").exists()


def test_the_defaults_run_on_8_devices_as_on_an_8_chip_tpu_host(tmp_path):
    """v6e-8 and v5litepod-8 hosts have 8 devices: 2 act and 6 learn the preset's 120 environments."""
    result = subprocess.run(
        [PYTHON, LAUNCHER, "--arch=sebulba", "--cpu-devices=8", "--total-steps=1",
         f"--run-dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["actor_devices"], summary["learner_devices"]) == (2, 6)
