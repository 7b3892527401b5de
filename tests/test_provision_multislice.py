"""Multislice (`--num-slices=N`): N slices as one queued resource, one run over all of
their hosts. The launcher against the scripted Cloud TPU API (tests/tpu_server.py),
the worker's part (its slice and the run's coordinator from `tpu-env`) against a local
metadata server, and the data axis's device order. The run itself, on an emulated
pod of 2 slices x 2 workers, is in tests/test_provision_pod.py (`multislice`)."""

import json
import sys
from dataclasses import dataclass

import pytest

pytest.importorskip("google.cloud.tpu_v2", reason="needs the tpu extra")

from metadata_server import MetadataServer, worker_endpoints  # noqa: E402
from emulated_pod import multislice_tpu_env  # noqa: E402

from podracer.command import main  # noqa: E402  (the front door)
from podracer.protocol.parallel import data_axis_order  # noqa: E402
from podracer.provision import api_requests  # noqa: E402
from podracer.provision.cli import check_command, parse_command  # noqa: E402
from podracer.provision.worker import Worker  # noqa: E402
from tests.test_provision_cli import (  # noqa: E402,F401  (its fixtures: the scripted API)
    BUCKET, NAME, PROJECT, ZONE, TRAINING, _dry_run_parts, _single_error_line,
    _worker_config, cli, launcher, server)
from tests.tpu_server import FakeTpuService, NodeState  # noqa: E402

PARENT = f"projects/{PROJECT}/locations/{ZONE}"
QUEUED = f"{PARENT}/queuedResources/{NAME}"
SLICES = [f"{PARENT}/nodes/{NAME}-0", f"{PARENT}/nodes/{NAME}-1"]
MULTISLICE = ("--queued", "--num-slices=2")
V4_16 = ("--accelerator-type=v4-16",)  # 2 hosts of 4 devices a slice


@pytest.fixture
def service():
    return FakeTpuService(workers=2)


@pytest.mark.parametrize("flags, fragment", [
    (["--num-slices=0", "--queued"], "--num-slices=0: a run needs at least one slice"),
    (["--num-slices=2"], "--num-slices=2 needs --queued: the Cloud TPU API creates several "
                         "slices together only as one queued resource"),
    (["--num-slices=2", "--queued", "--accelerator-type=v3-8"], "v3 has no multislice"),
    # Each slice must be a slice of its version: 2 v4 chips are none.
    (["--num-slices=2", "--queued", "--tpu-version=v4", "--topology=1x1x2"],
     "--topology=1x1x2 is not a v4 slice"),
])
def test_bad_multislice_input_is_one_line_exit_2_before_any_call(cli, service, flags, fragment):
    shape = tuple(flag for flag in flags if flag.startswith(("--accelerator", "--tpu-", "--top")))
    status, out, err = cli(*[flag for flag in flags if flag not in shape], *TRAINING,
                           shape=shape or V4_16)

    assert status == 2 and out == ""
    assert fragment in _single_error_line(err)
    assert service.requests == []


def test_the_layout_check_counts_every_slices_devices():
    anakin = ["--arch=anakin", "--algo=ppo", "--env=CartPole-v1", "--num-envs=8"]
    one = ["--tpu=s", "--zone=z", "--bucket=gs://b", *V4_16, "--queued", *anakin]
    check_command(parse_command(one))  # 8 environments over one v4-16's 8 devices

    with pytest.raises(Exception, match=r"^on 2 x v4-16 \(4 hosts of 4 devices\): .*16"):
        check_command(parse_command([*one, "--num-slices=2"]))


def test_dry_run_asks_for_two_slices_in_one_queued_resource(cli, service):
    status, out, err = cli("--dry-run", *MULTISLICE, *TRAINING, shape=V4_16)

    assert (status, err) == (0, "")
    assert service.requests == []
    sent, notes, script = _dry_run_parts(out)
    assert [entry["rpc"].rsplit("/", 1)[1] for entry in sent] == [
        "CreateQueuedResource", "GetQueuedResource", "GetNode", "GetNode",
        "GetGuestAttributes", "GetGuestAttributes", "DeleteQueuedResource"]
    (node_spec,) = sent[0]["request"]["queuedResource"]["tpu"]["nodeSpec"]
    assert node_spec["multisliceParams"] == {"nodeCount": 2, "nodeIdPrefix": NAME}
    assert "nodeId" not in node_spec and node_spec["node"]["acceleratorType"] == "v4-16"
    assert [entry["request"]["name"] for entry in sent[2:4]] == SLICES
    assert "# slice: 2 x v4-16 (4 hosts of 4 devices), one process of the run per host; the " \
           "run's layout was checked for it" in notes
    assert _worker_config(script)["num_slices"] == 2


def test_a_multislice_run_waits_for_every_slice_and_deletes_its_queued_resource(cli, service):
    status, out, err = cli(*MULTISLICE, *TRAINING, shape=V4_16)

    assert (status, err) == (0, "")
    (create,) = service.requests_of("CreateQueuedResource")
    params = create.queued_resource.tpu.node_spec[0].multislice_params
    assert (params.node_count, params.node_id_prefix) == (2, NAME)
    assert {request.name for request in service.requests_of("GetNode")} == set(SLICES)
    assert {request.name for request in service.requests_of("GetGuestAttributes")} == set(SLICES)
    assert f"TPU {NAME}-0: READY" in out and f"TPU {NAME}-1: READY" in out
    assert "workers: 4 exited 0" in out  # both slices' workers, counted together
    assert service.methods_called()[-1] == "DeleteQueuedResource"
    assert service.nodes == {} and service.queued == {}


def test_one_slice_preempted_restarts_every_slice(cli, service, gcs_bucket):
    service.worker_states = [["running"] * 2] * 4 + [["exit=0"] * 2]
    preempted = []

    def preempt_slice_1():
        with service._lock:
            slot = service.nodes.get(SLICES[1])
            if slot is not None and not preempted:
                preempted.append(1)
                slot.script = []
                slot.set_state(NodeState.PREEMPTED)

    service.on_call("GetGuestAttributes", preempt_slice_1, after_effect=True)
    status, out, err = cli(*MULTISLICE, "--max-restarts=1", *TRAINING, shape=V4_16)

    assert (status, err) == (0, ""), out
    assert f"TPU {NAME}-1 was PREEMPTED during the run; restart 1 of 1" in out
    # The whole queued resource went, both slices with it, and came back whole.
    assert service.methods_called().count("DeleteQueuedResource") == 2
    assert len(service.requests_of("CreateQueuedResource")) == 2
    node = service.requests_of("CreateQueuedResource")[0].queued_resource.tpu.node_spec[0].node
    run_dir = node.metadata[api_requests.RUN_DIR_KEY].removeprefix(BUCKET + "/")
    launch = json.loads(gcs_bucket.blob(f"{run_dir}/launch.json").download_as_text())
    assert [restart["reason"] for restart in launch["restarts"]] == [
        f"TPU {NAME}-1 was PREEMPTED during the run"]
    assert service.nodes == {} and service.queued == {}


def test_status_attach_and_down_find_a_multislice_by_its_name(cli, service):
    service.worker_states = [["running"] * 2] * 6 + [["exit=0"] * 2]
    status, out, err = cli(*MULTISLICE, "--detach", *TRAINING, shape=V4_16)
    assert (status, err) == (0, "") and f"detached: TPU {NAME} trains on" in out

    status, out, err = cli(NAME, verb="status", slice_flags=False)
    assert (status, err) == (0, "")
    assert f"queued resource {NAME}: ACTIVE" in out
    assert f"TPU {NAME}-0: READY" in out and f"TPU {NAME}-1: READY" in out
    assert out.count("  worker  address") == 2

    status, out, err = cli(NAME, verb="attach", slice_flags=False)
    assert (status, err) == (0, ""), out
    assert "the run finished on every worker" in out
    assert service.nodes == {} and service.queued == {}


def test_down_deletes_every_slice_with_the_queued_resource(cli, service):
    service.worker_states = [["running"] * 2]
    assert cli(*MULTISLICE, *TRAINING, verb="up", shape=V4_16)[0] == 0
    assert sorted(service.nodes) == SLICES

    status, out, err = cli(NAME, verb="down", slice_flags=False)

    assert (status, err) == (0, "")
    assert service.requests_of("DeleteQueuedResource")[0].force
    assert service.nodes == {} and service.queued == {}


def test_list_shows_a_waiting_multislice_once_and_an_active_one_by_its_slices():
    from google.cloud import tpu_v2

    from podracer.provision.report import list_table

    def multislice(name, state):
        return tpu_v2.QueuedResource(name=f"{PARENT}/queuedResources/{name}", tpu={"node_spec": [{
            "multislice_params": {"node_count": 2}, "node": {"accelerator_type": "v4-16"}}]},
            state={"state": state})

    nodes = [tpu_v2.Node(name=f"{PARENT}/nodes/a-{index}", accelerator_type="v4-16",
                         state=NodeState.READY, runtime_version="img",
                         queued_resource=f"{PARENT}/queuedResources/a") for index in range(2)]
    table = list_table(nodes, [multislice("a", tpu_v2.QueuedResourceState.State.ACTIVE),
                               multislice("b", tpu_v2.QueuedResourceState.State.WAITING_FOR_RESOURCES)])
    assert [row.split()[0] for row in table[1:]] == ["a-0", "a-1", "b"]
    assert "2 x v4-16" in table[3]


# -- the worker ------------------------------------------------------------------------


@pytest.mark.parametrize("slice_id, worker", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_each_worker_joins_one_run_numbered_slice_by_slice(tmp_path, monkeypatch, slice_id, worker):
    attributes = {"agent-worker-number": str(worker),
                  "worker-network-endpoints": worker_endpoints([f"10.0.{slice_id}.2",
                                                                f"10.0.{slice_id}.3"]),
                  "tpu-env": "ACCELERATOR_TYPE: 'v4-16'\n"
                             + multislice_tpu_env("10.0.0.2", 2, slice_id)}
    with MetadataServer(attributes) as metadata:
        monkeypatch.setenv("GCE_METADATA_HOST", metadata.host)
        monkeypatch.delenv("PODRACER_COORDINATOR_PORT", raising=False)
        config = {"run_dir": "gs://b/run", "training_flags": ["--arch=anakin"], "num_slices": 2}
        joined = Worker(config, str(tmp_path))

    command = joined.training_command({"launcher": "launch.py"})
    # Worker 0 of slice 0 coordinates, at jax.distributed's TPU port; processes slice-major.
    assert command[-3:] == ["--coordinator=10.0.0.2:8476", "--num-processes=4",
                            f"--process-id={2 * slice_id + worker}"]
    assert joined.megascale == {"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2:8080",
                                "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": str(slice_id),
                                "MEGASCALE_PORT": "8080"}
    assert joined.log_url == f"gs://b/run/logs/worker-{2 * slice_id + worker}.log"


def test_training_gets_the_multislice_variables_libtpu_reads(tmp_path, monkeypatch):
    """The worker's training process, for real: a stand-in launcher records what it got."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    launcher = tmp_path / "launcher.py"
    launcher.write_text("import json, os, sys\n"
                        "json.dump({'argv': sys.argv[1:], 'env': {k: v for k, v in os.environ.items()"
                        " if k.startswith('MEGASCALE_')}}, open('got.json', 'w'))\n")
    attributes = {"agent-worker-number": "1", "tpu-env": multislice_tpu_env("10.0.0.2", 2, 1),
                  "worker-network-endpoints": worker_endpoints(["10.0.1.2", "10.0.1.3"])}
    with MetadataServer(attributes) as metadata:
        monkeypatch.setenv("GCE_METADATA_HOST", metadata.host)
        monkeypatch.setenv("PODRACER_COORDINATOR_PORT", "9999")
        config = {"run_dir": "gs://b/run", "training_flags": [], "num_slices": 2,
                  "peer_poll_s": 600}  # the stand-in ends long before the worker looks at peers
        status = Worker(config, str(tmp_path))._train_once({"launcher": str(launcher)}, attempt=0)

    assert status == 0
    got = json.loads((tmp_path / "run" / "got.json").read_text())
    assert got["argv"][-3:] == ["--coordinator=10.0.0.2:9999", "--num-processes=4", "--process-id=3"]
    assert got["env"] == {"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2:8080", "MEGASCALE_NUM_SLICES": "2",
                          "MEGASCALE_SLICE_ID": "1", "MEGASCALE_PORT": "8080"}


@pytest.mark.parametrize("tpu_env, fragment", [
    ("", "has no MEGASCALE_COORDINATOR_ADDRESS, MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID"),
    (multislice_tpu_env("10.0.0.2", 3, 1), "says 3 slices, the launcher created 2"),
])
def test_a_worker_not_on_a_multislice_says_why_and_joins_nothing(tmp_path, monkeypatch,
                                                                 tpu_env, fragment):
    attributes = {"agent-worker-number": "0", "tpu-env": tpu_env,
                  "worker-network-endpoints": worker_endpoints(["10.0.0.2", "10.0.0.3"])}
    with MetadataServer(attributes) as metadata:
        monkeypatch.setenv("GCE_METADATA_HOST", metadata.host)
        joined = Worker({"run_dir": "gs://b/run", "num_slices": 2}, str(tmp_path))
    assert fragment in joined.not_a_slice and joined.megascale == {}


# -- the data axis -------------------------------------------------------------------


@dataclass(frozen=True)
class _Device:
    """What `create_hybrid_device_mesh` reads of a device (not a TPU: no physical layout)."""

    id: int
    slice_index: int
    platform: str = "cpu"
    device_kind: str = "stand-in"


def test_the_data_axis_spans_slices_one_slice_after_another():
    interleaved = [_Device(0, 1), _Device(1, 0), _Device(2, 1), _Device(3, 0)]
    assert [device.id for device in data_axis_order(interleaved)] == [1, 3, 0, 2]
    one_slice = [_Device(2, 0), _Device(0, 0)]
    assert [device.id for device in data_axis_order(one_slice)] == [2, 0]  # as given
