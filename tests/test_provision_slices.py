"""The slices' hosts and devices, and every run layout checked against them before paying."""

import pytest

from podracer.errors import PodracerError
from podracer.presets import PRESETS
from podracer.provision import preflight
from podracer.provision.slices import SliceShape, slice_shape


@pytest.mark.parametrize("accelerator, hosts, per_host", [
    ("v4-8", 1, 4), ("v4-32", 4, 4), ("v5p-8", 1, 4), ("v5p-128", 16, 4),
    ("v5litepod-1", 1, 1), ("v5litepod-4", 1, 4), ("v5litepod-8", 1, 8), ("v5litepod-16", 4, 4),
    ("v6e-8", 1, 8), ("v6e-16", 4, 4), ("v6e-256", 64, 4), ("v3-8", 1, 8), ("v2-32", 4, 8),
])
def test_accelerator_types_as_hosts_and_devices(accelerator, hosts, per_host):
    assert slice_shape(accelerator) == SliceShape(accelerator, hosts, per_host)


def test_topologies_count_chips():
    assert slice_shape("", "v4", "2x2x4") == SliceShape("v4 2x2x4", 4, 4)  # v4-32
    assert slice_shape("", "v6e", "2x4") == SliceShape("v6e 2x4", 1, 8)  # v6e-8
    assert slice_shape("", "v5litepod", "4x4") == SliceShape("v5litepod 4x4", 4, 4)


@pytest.mark.parametrize("accelerator", ["v4-6", "v4-12", "v6e-2", "v6e-6", "v5p-4"])
def test_sizes_no_slice_has_are_refused_in_one_line(accelerator):
    with pytest.raises(PodracerError, match=f"--accelerator-type={accelerator} is not a") as error:
        slice_shape(accelerator)
    assert "\n" not in str(error.value)


def test_a_version_the_table_does_not_know_is_left_to_the_api():
    assert slice_shape("v9z-8") is None


# One host of 1, 4 and 8 devices, and slices of several hosts.
SLICES = ["v5litepod-1", "v5litepod-4", "v6e-8", "v4-8", "v4-16"]


@pytest.mark.parametrize("arch, algo, env", [key for key in PRESETS if key[0] == "sebulba"]
                         + [("anakin", "ppo", "CartPole-v1")])
def test_every_sebulba_preset_fits_hosts_of_1_4_and_8_devices(arch, algo, env):
    for accelerator in SLICES:
        preflight.check_layout([f"--arch={arch}", f"--algo={algo}", f"--env={env}"],
                               slice_shape(accelerator))


@pytest.mark.parametrize("flags, fragment", [
    (["--arch=sebulba", "--num-envs=100"],
     "on v6e-8 (1 host of 8 devices): each actor thread's 50 environments do not split over "
     "6 learner devices; make --num-envs a multiple of 12"),
    (["--arch=sebulba", "--num-envs=20", "--actor-devices", "0", "1", "2"],
     "--num-envs=20 does not split over 3 actor threads"),
    (["--arch=anakin", "--num-envs=12"], "--num-envs=12 environments do not split over 8 devices"),
    (["--arch=anakin", "--algo=es", "--population=36"], "--population=36 population members do not split"),
    (["--arch=sebulba", "--algo=es", "--actor-devices", "0", "1", "2"],
     "--population=64 does not split over 3 actor threads"),
    (["--arch=anakin", "--algo=impala", "--num-envs=16"], "do not split into --minibatches=4"),
])
def test_layouts_that_cannot_work_on_the_slice_are_refused_with_the_fix(flags, fragment):
    with pytest.raises(PodracerError) as error:
        preflight.check_layout(flags, slice_shape("v6e-8"))
    message = str(error.value)
    assert fragment in message and "\n" not in message
    assert message.startswith("on v6e-8 (1 host of 8 devices): ")


def test_several_hosts_split_the_environments_over_every_hosts_actors():
    # v4-32: 4 hosts of 1 actor and 3 learners; 24 environments are 6 per host.
    preflight.check_layout(["--arch=sebulba", "--num-envs=24"], slice_shape("v4-32"))
    with pytest.raises(PodracerError, match=r"v4-32 \(4 hosts of 4 devices\): --num-envs=18 "
                                            r"does not split over 4 actor threads"):
        preflight.check_layout(["--arch=sebulba", "--num-envs=18"],
                               slice_shape("v4-32"))
