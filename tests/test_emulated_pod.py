"""The emulated pod slice itself (tests/emulated_pod.py), with a stand-in worker program
instead of podracer's, through the real TpuClient: each worker boots with its own disk,
metadata and the slice's coordinator port; preemptions, reboots, states and deletes do
to the processes what they do on Cloud TPU. (tests/test_provision_pod.py runs podracer
on it.)"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("google.cloud.tpu_v2", reason="needs the tpu extra")

import grpc  # noqa: E402
from google.auth.credentials import AnonymousCredentials  # noqa: E402
from google.cloud import tpu_v2  # noqa: E402
from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport  # noqa: E402

from emulated_pod import EmulatedPod, python_folders, wait_until, worker_environment  # noqa: E402
from tpu_server import FakeTpuService, NodeState, QueuedState, TpuServer  # noqa: E402

PARENT = "projects/proj/locations/us-central2-b"
NODE = f"{PARENT}/nodes/pod"
RUN_DIR = "gs://podracer-runs/runs/pod"

# Says what it was given, publishes its phase, leaves a child that ignores SIGTERM (as
# one stuck in a collective would: only SIGKILL ends it), and on SIGTERM notes it and exits.
FAKE_WORKER = r'''
import json, os, signal, subprocess, sys, time, urllib.error, urllib.request

home = os.environ["PODRACER_HOME"]
root = f"http://{os.environ['GCE_METADATA_HOST']}/computeMetadata/v1/instance/"


def metadata(path, data=None):
    request = urllib.request.Request(root + path, data=data, method="PUT" if data else "GET",
                                     headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.read().decode()


def attribute(name):
    try:
        return metadata("attributes/" + name)
    except urllib.error.HTTPError:  # 404: a single slice's workers have no tpu-env here
        return None


def stop(signum, frame):
    open(os.path.join(home, "terminated"), "w").close()
    metadata("guest-attributes/podracer/state", b"terminated")
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
with open(os.path.join(home, "boots"), "a") as f:
    f.write("boot\n")
with open(os.path.join(home, "boot.json"), "w") as f:
    json.dump({"worker": metadata("attributes/agent-worker-number"),
               "endpoints": metadata("attributes/worker-network-endpoints"),
               "run_dir": metadata("attributes/podracer-run-dir"),
               "port": os.environ["PODRACER_COORDINATOR_PORT"], "cwd": os.getcwd(),
               "tpu_env": attribute("tpu-env")}, f)
subprocess.Popen([sys.executable, "-c", "import signal, time; "
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
metadata("guest-attributes/podracer/state", b"running")
while True:
    time.sleep(0.1)
'''
WRITE_WORKER = f"""#!/bin/bash
cat >"$PODRACER_HOME/fake_worker.py" <<'EOF'
{FAKE_WORKER}
EOF
"""
# The worker as a unit of its own (as podracer's startup script runs it), with what it reads.
SCRIPT = WRITE_WORKER + """exec systemd-run --unit=fake-worker --collect -p KillMode=mixed \\
    -p WorkingDirectory="$PODRACER_HOME" --setenv=PODRACER_HOME="$PODRACER_HOME" \\
    --setenv=GCE_METADATA_HOST="$GCE_METADATA_HOST" \\
    --setenv=PODRACER_COORDINATOR_PORT="$PODRACER_COORDINATOR_PORT" \\
    "$(command -v python3)" "$PODRACER_HOME/fake_worker.py"
"""
# The worker as the script runner's child.
UNDER_THE_RUNNER = WRITE_WORKER + 'exec python3 "$PODRACER_HOME/fake_worker.py"\n'


@pytest.fixture
def pod(tmp_path):
    """(pod, client): a 2-worker emulated pod behind the test server, and a TpuClient of it."""
    service = FakeTpuService(workers=2)
    with EmulatedPod(service, tmp_path, worker_environment(), grace_s=0.5,
                     delete_grace_s=0.2) as emulated, TpuServer(service) as server:
        transport = TpuGrpcTransport(host=server.endpoint, credentials=AnonymousCredentials(),
                                     channel=lambda host, **_: grpc.insecure_channel(host))
        yield emulated, tpu_v2.TpuClient(transport=transport)


def _node(script=SCRIPT) -> tpu_v2.Node:
    return tpu_v2.Node(accelerator_type="v4-16", runtime_version="tpu-ubuntu2204-base",
                       metadata={"startup-script": script, "podracer-run-dir": RUN_DIR})


def _create(client, script=SCRIPT) -> None:
    operation = client.create_node(parent=PARENT, node_id="pod", node=_node(script))
    assert client.get_node(name=NODE).state == NodeState.CREATING  # the workers boot already
    operation.result(timeout=30)  # done once READY


def _running(pod) -> None:
    for worker in (0, 1):
        pod.wait_for_phase("pod", worker, "running", timeout=60)


def _home(pod, worker: int):
    return pod.root / "disks" / "pod" / f"worker-{worker}"


def _states(client) -> list[str]:
    answer = client.get_guest_attributes(
        request=tpu_v2.GetGuestAttributesRequest(name=NODE, query_path="podracer/"))
    return [item.value for attributes in answer.guest_attributes
            for item in attributes.query_value.items]


def test_each_worker_boots_with_its_own_disk_and_metadata_and_the_slices_port(pod):
    emulated, client = pod
    _create(client)
    for worker in (0, 1):
        assert emulated.wait_for_phase("pod", worker, "running", timeout=60) == "running"
    assert _states(client) == ["running", "running"]

    boots = [json.loads((_home(emulated, w) / "boot.json").read_text()) for w in (0, 1)]
    assert [boot["worker"] for boot in boots] == ["0", "1"]
    assert {boot["endpoints"] for boot in boots} == {"unknown:unknown:127.0.0.1,unknown:unknown:127.0.0.1"}
    assert {boot["run_dir"] for boot in boots} == {RUN_DIR}  # the node's other metadata
    assert boots[0]["port"] == boots[1]["port"]
    assert [boot["cwd"] for boot in boots] == [str(_home(emulated, w)) for w in (0, 1)]
    node = client.get_node(name=NODE)
    assert [e.ip_address for e in node.network_endpoints] == ["127.0.0.1", "127.0.0.1"]
    assert len(emulated.alive()) == 2

    client.delete_node(name=NODE).result(timeout=30)  # done once the workers are stopped
    assert emulated.alive() == {} and not (emulated.root / "disks" / "pod").exists()
    assert not (_home(emulated, 0) / "terminated").exists()  # the disk went with the node
    assert "--- boot 1 ---" in emulated.consoles()  # the consoles outlive it
    emulated.assert_nothing_left()


def test_a_preemption_sigterms_the_workers_kills_what_stays_and_the_node_stays_listed(pod):
    emulated, client = pod
    _create(client)
    _running(emulated)

    emulated.preempt("pod")

    assert emulated.alive() == {}  # the SIGTERM-ignoring children were killed after the grace
    assert all((_home(emulated, w) / "terminated").exists() for w in (0, 1))
    assert _states(client) == ["terminated", "terminated"]
    assert client.get_node(name=NODE).state == NodeState.PREEMPTED
    assert [n.name for n in client.list_nodes(parent=PARENT)] == [NODE]
    with pytest.raises(AssertionError, match="left behind: nodes"):
        emulated.assert_nothing_left(timeout=0.5)
    client.delete_node(name=NODE).result(timeout=30)
    emulated.assert_nothing_left()


def test_a_shutdown_sigterms_the_script_runner_only_and_kills_what_it_started_after_the_grace(pod):
    """The guest agent's service has `KillMode=process`: a program the startup script
    runs itself never sees the shutdown's SIGTERM, only the SIGKILL at its end."""
    emulated, client = pod
    _create(client, UNDER_THE_RUNNER)
    _running(emulated)

    emulated.preempt("pod", grace_s=1.0)

    assert emulated.alive() == {}
    assert not any((_home(emulated, w) / "terminated").exists() for w in (0, 1))
    assert _states(client) == ["running", "running"]


def test_a_reboot_runs_the_startup_script_again_on_the_same_disk(pod):
    emulated, client = pod
    _create(client)
    _running(emulated)
    before = dict(emulated.alive())

    emulated.reboot("pod", 1)

    assert (_home(emulated, 1) / "terminated").exists()  # shut down with SIGTERM first
    wait_until(lambda: (_home(emulated, 1) / "boots").read_text() == "boot\nboot\n",
                        60, "worker 1's second boot")
    emulated.wait_for_phase("pod", 1, "running", timeout=60)
    assert (_home(emulated, 0) / "boots").read_text() == "boot\n"
    after = emulated.alive()
    assert after[f"{NODE} worker 0"] == before[f"{NODE} worker 0"]
    assert set(after[f"{NODE} worker 1"]).isdisjoint(before[f"{NODE} worker 1"])
    assert emulated.consoles().count("--- boot 2 ---") == 1


def test_states_can_be_set_and_a_condition_can_trigger_a_preemption(pod):
    emulated, client = pod
    _create(client)
    emulated.set_state("pod", NodeState.REPAIRING)
    assert client.get_node(name=NODE).state == NodeState.REPAIRING
    emulated.set_state("pod", NodeState.READY)
    assert client.get_node(name=NODE).state == NodeState.READY

    emulated.when(lambda: emulated.phase("pod", 0) == "running", lambda: emulated.preempt("pod"))
    wait_until(lambda: client.get_node(name=NODE).state == NodeState.PREEMPTED, 60, "PREEMPTED")
    assert emulated.alive() == {}


def test_a_queued_resource_boots_its_node_when_active_and_its_delete_stops_it(pod):
    emulated, client = pod
    name = f"{PARENT}/queuedResources/pod"
    resource = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[
        tpu_v2.QueuedResource.Tpu.NodeSpec(parent=PARENT, node_id="pod", node=_node())]))
    client.create_queued_resource(parent=PARENT, queued_resource_id="pod",
                                  queued_resource=resource).result(timeout=30)
    assert emulated.alive() == {}  # waiting for resources: nothing boots
    wait_until(lambda: client.get_queued_resource(name=name).state.state == QueuedState.ACTIVE,
               30, "ACTIVE")
    emulated.wait_for_phase("pod", 0, "running", timeout=60)

    emulated.preempt("pod", grace_s=0)
    assert client.get_queued_resource(name=name).state.state == QueuedState.SUSPENDED
    delete = tpu_v2.DeleteQueuedResourceRequest(name=name, force=True)
    client.delete_queued_resource(request=delete).result(timeout=30)
    emulated.assert_nothing_left()


def test_a_multislice_queued_resource_boots_every_slice_with_its_tpu_env_and_one_port(pod):
    emulated, client = pod
    params = tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(node_count=2, node_id_prefix="pod")
    resource = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[
        tpu_v2.QueuedResource.Tpu.NodeSpec(parent=PARENT, multislice_params=params, node=_node())]))
    client.create_queued_resource(parent=PARENT, queued_resource_id="pod",
                                  queued_resource=resource).result(timeout=30)
    name = f"{PARENT}/queuedResources/pod"
    wait_until(lambda: client.get_queued_resource(name=name).state.state == QueuedState.ACTIVE,
               30, "ACTIVE")
    for node in ("pod-0", "pod-1"):
        for worker in (0, 1):
            emulated.wait_for_phase(node, worker, "running", timeout=60)

    nodes = {node.name.rsplit("/", 1)[1]: node for node in client.list_nodes(parent=PARENT)}
    assert sorted(nodes) == ["pod-0", "pod-1"]
    assert all(node.queued_resource == name and node.multislice_node for node in nodes.values())
    boots = {(node, worker): json.loads((emulated.root / "disks" / node / f"worker-{worker}" /
                                         "boot.json").read_text())
             for node in ("pod-0", "pod-1") for worker in (0, 1)}
    assert len({boot["port"] for boot in boots.values()}) == 1  # one run's coordinator port
    for (node, worker), boot in boots.items():
        slice_id = node[-1]
        assert boot["worker"] == str(worker)
        assert boot["tpu_env"] == (f"MEGASCALE_COORDINATOR_ADDRESS: '127.0.0.1:8080'\n"
                                   f"MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '{slice_id}'\n"
                                   f"MEGASCALE_PORT: '8080'\n")

    emulated.preempt("pod-1", grace_s=0)  # one slice: the other trains on
    assert len(emulated.alive()) == 2 and client.get_node(name=f"{PARENT}/nodes/pod-0").state == NodeState.READY
    delete = tpu_v2.DeleteQueuedResourceRequest(name=name, force=True)
    client.delete_queued_resource(request=delete).result(timeout=30)
    emulated.assert_nothing_left()


def test_waiting_for_a_phase_fails_at_once_with_the_console_when_the_worker_is_gone(pod):
    emulated, client = pod
    _create(client, "echo no such program here; exit 3")
    with pytest.raises(AssertionError, match="(?s)stopped at None before 'running'.*no such program"):
        emulated.wait_for_phase("pod", 0, "running", timeout=60)
    assert os.path.exists(_home(emulated, 0))


def test_the_workers_uv_finds_the_python_of_a_venv_that_runs_the_tests(tmp_path):
    """Tests run from a venv (the usual install): the workers' `uv venv --python X.Y`, with
    downloads off, finds a Python on the PATH the workers get, and it is this version."""
    from uv import find_uv_bin

    venv = tmp_path / "tests-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    base_prefix = subprocess.run([python, "-c", "import sys; print(sys.base_prefix)"], check=True,
                                 capture_output=True, text=True, timeout=60).stdout.strip()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {"PATH": os.pathsep.join(python_folders(str(python), base_prefix)), "UV_NO_CONFIG": "1",
           "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
    made = subprocess.run([find_uv_bin(), "venv", "--python", version, tmp_path / "worker-venv"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    made_version = subprocess.run([tmp_path / "worker-venv" / "bin" / "python", "-c",
                                   "import sys; print(*sys.version_info[:2], sep='.')"],
                                  check=True, capture_output=True, text=True, timeout=60).stdout
    assert made_version.strip() == version
