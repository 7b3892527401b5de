"""The provisioner end to end: the real `TpuClient` over plaintext gRPC against a
scripted Cloud TPU API on 127.0.0.1 (tests/tpu_server.py)."""

import _thread
import json
import signal
import time

import pytest

pytest.importorskip("google.cloud.tpu_v2", reason="needs the tpu extra")
import grpc
from google.cloud import tpu_v2

from podracer.provision import api_requests
from podracer.command import main  # the front door: `python launch/tpu.py ...`
from tests.tpu_server import FakeTpuService, NodeState, QueuedState, TpuServer

NAME, ZONE, PROJECT = "slice-1", "us-central2-b", "proj"
NODE = f"projects/{PROJECT}/locations/{ZONE}/nodes/{NAME}"
QUEUED = f"projects/{PROJECT}/locations/{ZONE}/queuedResources/{NAME}"
BUCKET = "gs://podracer-runs"
TRAINING = ["--arch=sebulba", "--algo=ppo", "--env=Pong-v5"]


@pytest.fixture
def service():
    return FakeTpuService(workers=4)


@pytest.fixture
def server(service):
    with TpuServer(service) as running:
        yield running


@pytest.fixture
def launcher(tmp_path):
    path = tmp_path / "tpu.py"
    path.write_text("import sys\nprint(sys.argv)\n")
    return path


@pytest.fixture
def cli(server, launcher, capsys, gcs_bucket):
    """Runs the provisioner against the test server: (exit status, stdout, stderr)."""

    def run(*argv, verb=None, slice_flags=True, shape=("--accelerator-type=v4-32",)):
        flags = [f"--zone={ZONE}", f"--project={PROJECT}",
                 f"--api-endpoint={server.endpoint}", "--poll-interval=0.01",
                 "--retry-deadline=2", "--ready-timeout=10", "--max-run-time=60"]
        if slice_flags:
            flags += [f"--tpu={NAME}", *shape, f"--launcher={launcher}", f"--bucket={BUCKET}"]
        status = main(([verb] if verb else []) + flags + list(argv))
        out, err = capsys.readouterr()
        return status, out, err

    return run


def _single_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def _worker_config(script: str) -> dict:
    """The worker's configuration, as the startup script writes it."""
    return json.loads(script.split("<<'PODRACER_CONFIG_EOF'\n", 1)[1].split("\n", 1)[0])


def test_run_creates_the_slice_runs_on_every_worker_and_deletes_it(cli, service, gcs_bucket):
    status, out, err = cli(*TRAINING)

    assert (status, err) == (0, "")
    methods = service.methods_called()
    assert methods[0] == "CreateNode" and methods[-1] == "DeleteNode"
    assert "GetOperation" in methods and "GetGuestAttributes" in methods
    (create,) = service.requests_of("CreateNode")
    assert create.parent == f"projects/{PROJECT}/locations/{ZONE}" and create.node_id == NAME
    assert create.node.accelerator_type == "v4-32"
    assert create.node.runtime_version == "tpu-ubuntu2204-base"
    # External IPs unless --internal-ips, as gcloud; the API's own default would be none.
    assert create.node.network_config == tpu_v2.NetworkConfig(enable_external_ips=True)
    for absent in ("service_account", "scheduling_config", "accelerator_config"):
        assert absent not in create.node
    assert list(create.node.tags) == []
    run_dir = create.node.metadata[api_requests.RUN_DIR_KEY]
    assert run_dir.startswith(f"{BUCKET}/runs/{NAME}-sebulba-ppo-Pong-v5-")
    config = _worker_config(create.node.metadata["startup-script"])
    assert config["training_flags"] == TRAINING and config["run_dir"] == run_dir
    # The code was staged in the bucket before the slice was created.
    prefix = run_dir.removeprefix(BUCKET + "/") + "/code/"
    staged = sorted(blob.name.removeprefix(prefix) for blob in gcs_bucket.list_blobs(prefix=prefix))
    assert staged == sorted(config["files"].values())
    assert config["files"]["wheel"].startswith("podracer_rl-0.1.0+g")
    assert service.nodes == {}
    assert "TPU slice-1: CREATING" in out and "TPU slice-1: READY" in out
    assert "workers: 4 installing" in out and "workers: 4 exited 0" in out
    assert f"run directory: {run_dir}" in out and f"{run_dir}/logs/worker-I.log" in out
    assert f"python launch/tpu.py logs {NAME} --zone={ZONE} --project={PROJECT} --worker=0 --follow" in out
    assert f"no summary.json in {run_dir}" in out  # these workers are scripted, not real
    assert "deleted TPU slice-1" in out


def test_up_leaves_it_running_status_reports_workers_and_down_deletes(cli, service):
    service.worker_states = [["running"] * 4]

    status, out, err = cli(*TRAINING, verb="up")
    assert (status, err) == (0, "")
    assert list(service.nodes) == [NODE]
    assert "DeleteNode" not in service.methods_called()
    assert f"until you run: python launch/tpu.py down --tpu={NAME} --zone={ZONE}" in out

    status, out, err = cli(NAME, verb="status", slice_flags=False)
    assert (status, err) == (0, "")
    assert "TPU slice-1: READY" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and "10.0.0." in line]
    assert rows == [[str(index), f"10.0.0.{index + 2}", "running"] for index in range(4)]

    status, out, err = cli(f"--tpu={NAME}", verb="down", slice_flags=False)
    assert (status, err) == (0, "")
    assert service.nodes == {}
    assert service.requests_of("DeleteNode")[0].name == NODE


def test_list_shows_the_zone(cli, service):
    service.worker_states = [["running"] * 4]
    assert cli(*TRAINING, verb="up")[0] == 0

    status, out, err = cli(verb="list", slice_flags=False)

    assert (status, err) == (0, "")
    assert out.splitlines()[1].split() == [NAME, "v4-32", "READY", "tpu-ubuntu2204-base", "-"]
    assert service.requests_of("ListNodes")[0].parent == f"projects/{PROJECT}/locations/{ZONE}"


def test_queued_spot_slice_waits_for_capacity_and_is_deleted_with_its_node(cli, service):
    status, out, err = cli("--queued", "--spot", *TRAINING)

    assert (status, err) == (0, "")
    (create,) = service.requests_of("CreateQueuedResource")
    assert create.queued_resource_id == NAME and create.request_id
    assert "spot" in create.queued_resource
    assert create.queued_resource.queueing_policy.valid_until_duration.total_seconds() == 10
    for state in ("WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"):
        assert f"queued resource {NAME}: {state}" in out
    (delete,) = service.requests_of("DeleteQueuedResource")
    assert delete.name == QUEUED and delete.force
    assert service.nodes == {} and service.queued == {}


def test_failed_queued_resource_is_reported_and_removed(cli, service):
    service.queued_states = [QueuedState.WAITING_FOR_RESOURCES, QueuedState.FAILED]

    status, out, err = cli("--queued", *TRAINING)

    assert status == 1
    line = _single_error_line(err)
    assert "queued resource slice-1 failed: no capacity" in line and "deleted" in line
    assert service.queued == {}


def test_preemption_during_the_run_is_reported_and_the_slice_deleted(cli, service):
    service.node_states = [NodeState.CREATING, NodeState.READY, NodeState.READY,
                           NodeState.PREEMPTED]
    service.worker_states = [["running"] * 4]

    status, out, err = cli(*TRAINING)

    assert status == 1
    line = _single_error_line(err)
    assert "PREEMPTED" in line and "TPU slice-1 deleted" in line
    assert service.nodes == {}


def test_a_failed_worker_ends_the_run_with_status_1_and_the_slice_deleted(cli, service):
    service.worker_states = [["running"] * 4, ["running", "exit=3", "running", "running"]]

    status, out, err = cli(*TRAINING)

    assert status == 1
    line = _single_error_line(err)
    assert "worker 1 exited 3" in line and "TPU slice-1 deleted" in line
    # Its log is named where it outlives the slice: in the run's bucket.
    assert f"{BUCKET}/runs/" in line and "/logs/worker-1.log" in line
    assert f"python launch/tpu.py logs {NAME} --zone={ZONE} --project={PROJECT} --worker=1" in line
    assert "/opt/podracer" not in out + err
    assert service.nodes == {}


def test_keep_keeps_the_slice_even_after_a_failure(cli, service):
    service.worker_states = [["exit=1"] * 4]

    status, out, err = cli("--keep", *TRAINING)

    assert status == 1
    assert "kept (--keep)" in _single_error_line(err)
    assert "DeleteNode" not in service.methods_called()
    assert list(service.nodes) == [NODE]


@pytest.mark.parametrize("code, fragment", [
    (grpc.StatusCode.PERMISSION_DENIED, "permission denied while creating TPU slice-1"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "no capacity or quota for v4-32 in us-central2-b"),
    (grpc.StatusCode.INVALID_ARGUMENT, "check --accelerator-type"),
    (grpc.StatusCode.NOT_FOUND, "check --tpu, --zone and --project"),
])
def test_create_errors_are_one_line_exit_2_and_leave_nothing(cli, service, code, fragment):
    service.fail("CreateNode", code, message="the server\nsays no")

    status, out, err = cli(*TRAINING)

    assert status == 2
    line = _single_error_line(err)
    assert fragment in line and "the server says no" in line
    assert service.methods_called() == ["CreateNode"]
    assert service.nodes == {}


def test_a_stockout_reported_by_the_create_operation_deletes_the_half_made_slice(cli, service):
    service.create_error = (grpc.StatusCode.RESOURCE_EXHAUSTED, "no more v4 in this zone")

    status, out, err = cli(*TRAINING)

    assert status == 2
    line = _single_error_line(err)
    assert "no capacity or quota" in line and "no more v4 in this zone" in line
    assert "TPU slice-1 deleted" in line
    assert service.requests_of("DeleteNode") and service.nodes == {}


def test_unavailable_is_retried_with_backoff_until_it_works(cli, service):
    service.fail("CreateNode", grpc.StatusCode.UNAVAILABLE, times=2)
    service.fail("GetNode", grpc.StatusCode.UNAVAILABLE, times=3)
    service.fail("GetOperation", grpc.StatusCode.DEADLINE_EXCEEDED, times=1)

    status, out, err = cli(*TRAINING)

    assert (status, err) == (0, "")
    assert service.methods_called().count("CreateNode") == 3
    assert service.nodes == {}


def test_unavailable_forever_gives_up_in_bounded_time_and_still_cleans_up(cli, service):
    service.fail("GetNode", grpc.StatusCode.UNAVAILABLE, times=10_000)

    started = time.monotonic()
    status, out, err = cli("--retry-deadline=0.5", *TRAINING)

    assert time.monotonic() - started < 10
    assert status == 2
    line = _single_error_line(err)
    assert "stayed unavailable for 0.5 s" in line and "TPU slice-1 deleted" in line
    assert service.nodes == {}


def test_a_lost_create_response_adopts_our_own_slice(cli, service):
    service.fail("CreateNode", grpc.StatusCode.UNAVAILABLE, after_effect=True)

    status, out, err = cli(*TRAINING)

    assert (status, err) == (0, "")
    assert service.methods_called().count("CreateNode") == 2
    assert service.requests_of("DeleteNode") and service.nodes == {}


def test_someone_elses_slice_of_the_same_name_is_left_alone(cli, service):
    stranger = tpu_v2.Node(accelerator_type="v4-8", labels={api_requests.LAUNCH_ID_LABEL: "other"})
    service.nodes[NODE] = service._new_node(NODE, stranger)

    status, out, err = cli(*TRAINING)

    assert status == 2
    assert "a TPU named slice-1 already exists" in _single_error_line(err)
    assert "DeleteNode" not in service.methods_called()
    assert list(service.nodes) == [NODE]


def test_slice_not_ready_in_time_is_deleted(cli, service):
    service.node_states = [NodeState.CREATING]

    status, out, err = cli("--ready-timeout=0.2", *TRAINING)

    assert status == 1
    line = _single_error_line(err)
    assert "TPU slice-1 was not ready after 0.2 s" in line and "deleted" in line
    assert service.nodes == {}


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt, as in a terminal. A process started in the background
    by a non-interactive shell ignores SIGINT, and Python then leaves it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_the_run_deletes_the_slice(cli, service, ctrl_c_raises):
    service.worker_states = [["running"] * 4]
    interrupted = []

    def press_ctrl_c():
        if not interrupted:
            interrupted.append(True)
            _thread.interrupt_main()

    service.on_call("GetGuestAttributes", press_ctrl_c)

    status, out, err = cli(*TRAINING)

    assert status == 130, err
    assert "interrupted; TPU slice-1 deleted" in _single_error_line(err)
    assert service.nodes == {}


def test_ctrl_c_while_the_create_is_in_flight_still_deletes_the_slice(cli, service, ctrl_c_raises):
    service.on_call("CreateNode", _thread.interrupt_main, after_effect=True)

    status, out, err = cli(*TRAINING)

    assert status == 130
    assert "interrupted; TPU slice-1 deleted" in _single_error_line(err)
    assert service.requests_of("DeleteNode") and service.nodes == {}


def test_a_failed_clean_up_says_how_to_finish_it(cli, service):
    service.worker_states = [["exit=1"] * 4]
    service.fail("DeleteNode", grpc.StatusCode.PERMISSION_DENIED, message="no delete for you")

    status, out, err = cli(*TRAINING)

    assert status == 1
    line = _single_error_line(err)
    assert "worker 0 exited 1" in line and "deleting TPU slice-1 failed too" in line
    assert "no delete for you" in line
    assert f"delete it with: python launch/tpu.py down --tpu={NAME} --zone={ZONE}" in line
    assert list(service.nodes) == [NODE]


def test_a_refused_create_reports_that_nothing_was_left(cli, service):
    service.fail("CreateNode", grpc.StatusCode.UNAVAILABLE, times=10_000)

    status, out, err = cli("--retry-deadline=0.3", *TRAINING)

    assert status == 2
    line = _single_error_line(err)
    assert "stayed unavailable" in line and "no TPU was left behind" in line
    assert service.requests_of("DeleteNode") and service.nodes == {}


def test_status_and_down_of_a_missing_slice_say_so(cli, service):
    for verb in ("status", "down"):
        status, out, err = cli(f"--tpu={NAME}", verb=verb, slice_flags=False)
        assert status == 2
        assert "no TPU named slice-1 in us-central2-b" in _single_error_line(err)
    assert "DeleteNode" not in service.methods_called()


def test_down_of_a_queued_slice_deletes_the_queued_resource_with_force(cli, service):
    service.worker_states = [["running"] * 4]
    assert cli("--queued", *TRAINING, verb="up")[0] == 0
    assert list(service.nodes) == [NODE] and list(service.queued) == [QUEUED]

    status, out, err = cli(NAME, verb="down", slice_flags=False)

    assert (status, err) == (0, "")
    (delete,) = service.requests_of("DeleteQueuedResource")
    assert delete.name == QUEUED and delete.force
    assert service.nodes == {} and service.queued == {}


def _dry_run_parts(out: str) -> tuple[list, list[str], str]:
    """The JSON requests, the `# ` note lines, and the startup script of a --dry-run."""
    requests_json, _, rest = out.partition("\n# ")
    notes, _, script = ("# " + rest).partition("# startup script")
    return json.loads(requests_json), notes.splitlines(), script.split("\n", 1)[1]


def test_dry_run_prints_the_requests_and_script_and_sends_nothing(cli, service):
    status, out, err = cli("--dry-run", *TRAINING, "--wandb-project=$(rm -rf /)")

    assert (status, err) == (0, "")
    assert service.requests == []
    sent, notes, printed_script = _dry_run_parts(out)
    assert notes[0].startswith(f"# run directory: {BUCKET}/runs/{NAME}-sebulba-ppo-Pong-v5-")
    assert [entry["rpc"].rsplit("/", 1)[1] for entry in sent] == [
        "CreateNode", "GetNode", "GetGuestAttributes", "DeleteNode"]
    node = sent[0]["request"]["node"]
    assert sent[0]["request"]["nodeId"] == NAME
    assert node["acceleratorType"] == "v4-32"
    assert node["runtimeVersion"] == "tpu-ubuntu2204-base"
    assert printed_script == node["metadata"]["startup-script"]
    # What would be staged, built but not uploaded; the run's flags are in the
    # script's configuration as given.
    staged = [line for line in notes if line.startswith("#   gs://")]
    assert [line.split()[1].rsplit("/", 1)[1] for line in staged][1:] == [
        "requirements.lock", "launcher.py"]
    assert _worker_config(printed_script)["training_flags"] == [*TRAINING, "--wandb-project=$(rm -rf /)"]
    assert sent[3]["request"]["name"] == NODE


def test_dry_run_of_up_with_keep_never_deletes(cli, service):
    status, out, err = cli("--dry-run", "--queued", *TRAINING, verb="up")

    assert (status, err) == (0, "")
    sent = _dry_run_parts(out)[0]
    assert [entry["rpc"].rsplit("/", 1)[1] for entry in sent] == [
        "CreateQueuedResource", "GetQueuedResource", "GetNode"]
    assert service.requests == []


@pytest.fixture
def adc_env(monkeypatch, tmp_path):
    """Application Default Credentials from a file of our choosing, and nothing else."""
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    monkeypatch.delenv("GCLOUD_PROJECT", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")

    def use(path):
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))

    return use


def test_no_credentials_is_one_line_naming_the_login_command(adc_env, tmp_path, capsys):
    adc_env(tmp_path / "missing.json")

    status = main(["status", f"--tpu={NAME}", f"--zone={ZONE}", f"--project={PROJECT}"])

    assert status == 2
    line = _single_error_line(capsys.readouterr().err)
    assert "no Google Cloud credentials found" in line
    assert "gcloud auth application-default login" in line


def test_credentials_never_appear_in_the_output(adc_env, tmp_path, capsys):
    secrets = {"client_secret": "CLIENT-SECRET-7f3a", "refresh_token": "1//REFRESH-TOKEN-9c2e"}
    key_file = tmp_path / "adc.json"
    key_file.write_text(json.dumps({"type": "authorized_user", "client_id": "id-1", **secrets}))
    adc_env(key_file)

    # Not loopback, so ADC is used; the host does not resolve, so every call fails.
    status = main(["status", f"--tpu={NAME}", f"--zone={ZONE}", f"--project={PROJECT}",
                   "--retry-deadline=0.5", "--api-endpoint=tpu.invalid:443"])

    out, err = capsys.readouterr()
    assert status == 2
    assert "stayed unavailable" in _single_error_line(err)
    for secret in secrets.values():
        assert secret not in out + err


def test_a_loopback_endpoint_needs_no_credentials_but_a_project(adc_env, tmp_path, server, capsys):
    adc_env(tmp_path / "missing.json")

    status = main(["list", f"--zone={ZONE}", f"--api-endpoint={server.endpoint}"])
    assert status == 2
    assert "pass --project=PROJECT_ID" in _single_error_line(capsys.readouterr().err)

    status = main(["list", f"--zone={ZONE}", f"--project={PROJECT}",
                   f"--api-endpoint={server.endpoint}"])
    out, err = capsys.readouterr()
    assert (status, err) == (0, "")
    assert out == f"no TPUs in {ZONE} (project {PROJECT})\n"


def test_a_queued_resource_that_never_gets_capacity_gives_up_and_is_removed(cli, service):
    service.queued_states = [QueuedState.WAITING_FOR_RESOURCES]

    status, out, err = cli("--queued", "--ready-timeout=0.2", *TRAINING)

    assert status == 1
    line = _single_error_line(err)
    assert "queued resource slice-1 was not provisioned after 0.2 s" in line
    assert "TPU slice-1 deleted" in line
    assert service.queued == {}


# -- what the create request carries: network, identity, tags, tier, shape --------

SERVICE_ACCOUNT = "trainer@proj.iam.gserviceaccount.com"
STORAGE_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"


def test_plain_create_carries_network_identity_tags_tier_and_topology(cli, service):
    status, out, err = cli(
        "--vpc-network=tpu-net", "--subnetwork=projects/host/regions/us-central2/subnetworks/tpu-sub",
        "--tags=podracer,allow-ssh", "--tags", "trainers", f"--service-account={SERVICE_ACCOUNT}",
        "--reserved", "--internal-ips", *TRAINING,
        shape=("--tpu-version=v4", "--topology=2x2x4"))

    assert (status, err) == (0, "")
    (create,) = service.requests_of("CreateNode")
    node = create.node
    assert node.network_config == tpu_v2.NetworkConfig(
        network="tpu-net", subnetwork="projects/host/regions/us-central2/subnetworks/tpu-sub",
        enable_external_ips=False)
    assert node.service_account == tpu_v2.ServiceAccount(
        email=SERVICE_ACCOUNT, scope=["https://www.googleapis.com/auth/cloud-platform"])
    assert list(node.tags) == ["podracer", "allow-ssh", "trainers"]
    assert node.scheduling_config == tpu_v2.SchedulingConfig(reserved=True)
    assert node.accelerator_config == tpu_v2.AcceleratorConfig(
        type_=tpu_v2.AcceleratorConfig.Type.V4, topology="2x2x4")
    assert node.accelerator_type == "" and node.runtime_version == "tpu-ubuntu2204-base"
    assert "creating TPU slice-1 (v4 2x2x4)" in out
    assert "network: tpu-net, internal IPs, service account: " + SERVICE_ACCOUNT in out
    assert "only through Cloud NAT" in out


def test_queued_create_carries_them_in_its_node_spec_and_spot_on_its_tier(cli, service):
    status, out, err = cli(
        "--queued", "--spot", "--vpc-network=tpu-net", "--tags=podracer",
        f"--service-account={SERVICE_ACCOUNT}", f"--scopes={STORAGE_SCOPE}", *TRAINING,
        shape=("--tpu-version=v5litepod", "--topology=4x4"))

    assert (status, err) == (0, "")
    (create,) = service.requests_of("CreateQueuedResource")
    resource = create.queued_resource
    (node_spec,) = resource.tpu.node_spec
    node = node_spec.node
    assert node.network_config == tpu_v2.NetworkConfig(network="tpu-net", enable_external_ips=True)
    assert node.service_account == tpu_v2.ServiceAccount(email=SERVICE_ACCOUNT, scope=[STORAGE_SCOPE])
    assert list(node.tags) == ["podracer"]
    assert node.accelerator_config == tpu_v2.AcceleratorConfig(
        type_=tpu_v2.AcceleratorConfig.Type.V5LITE_POD, topology="4x4")
    assert node.runtime_version == "v2-alpha-tpuv5-lite"
    # The tier is the queued resource's: spot there, no scheduling config on the node.
    assert "spot" in resource and "scheduling_config" not in node
    assert resource.reservation_name == ""


def test_queued_reserved_asks_for_any_reservation_of_the_project_in_the_zone(cli, service):
    status, out, err = cli("--queued", "--reserved", *TRAINING)

    assert (status, err) == (0, "")
    (create,) = service.requests_of("CreateQueuedResource")
    resource = create.queued_resource
    assert resource.reservation_name == f"projects/{PROJECT}/locations/{ZONE}/reservations/-"
    assert "spot" not in resource and "scheduling_config" not in resource.tpu.node_spec[0].node
    assert resource.tpu.node_spec[0].node.network_config.enable_external_ips


def test_dry_run_prints_the_network_identity_tags_tier_and_shape(cli, service):
    status, out, err = cli(
        "--dry-run", "--internal-ips", "--vpc-network=tpu-net", "--tags=podracer,allow-ssh",
        f"--service-account={SERVICE_ACCOUNT}", "--spot", *TRAINING,
        shape=("--tpu-version=v4", "--topology=2x2x4"))

    assert (status, err) == (0, "")
    assert service.requests == []
    sent, notes, _ = _dry_run_parts(out)
    node = sent[0]["request"]["node"]
    # enableExternalIps is false, so, as on the wire, absent; the notes say so.
    assert node["networkConfig"] == {"network": "tpu-net"}
    assert any("--internal-ips: networkConfig.enableExternalIps is false" in note for note in notes)
    assert node["serviceAccount"] == {
        "email": SERVICE_ACCOUNT, "scope": ["https://www.googleapis.com/auth/cloud-platform"]}
    assert node["tags"] == ["podracer", "allow-ssh"]
    assert node["schedulingConfig"] == {"spot": True}
    assert node["acceleratorConfig"] == {"type": "V4", "topology": "2x2x4"}
    assert "acceleratorType" not in node

    status, out, err = cli("--dry-run", *TRAINING)
    node = _dry_run_parts(out)[0][0]["request"]["node"]
    assert node["networkConfig"] == {"enableExternalIps": True}
    assert "serviceAccount" not in node and "tags" not in node


# -- checked before anything is paid for: one line, exit 2, no call at all --------

@pytest.mark.parametrize("training, fragment", [
    (["--arch=sebulba", "--totl-steps=5"],
     "unknown flag --totl-steps; did you mean --total-steps (a training flag)?"),
    (["--arch=sebulba", "--env=Pongg-v5"], "unknown envpool environment 'Pongg-v5'"),
    (["--arch=sebulba", "--env=Pong-v5", "--gamma=2"], "--gamma must be in [0, 1], got 2.0"),
    (["--arch=anakin", "--env=Pong-v5"], "Pong-v5 is an envpool environment"),
    (["--arch=anakin", "--algo=es", "--clip-eps=0.1"], "--clip-eps is a ppo setting"),
    (["--arch=sebulba", "--env=Pong-v5", "--num-processes=4"], "--num-processes is set by the slice"),
    (["--arch=sebulba", "--env=Pong-v5", "--", "--totl-steps=5"],
     "did you mean --total-steps (a training flag)?"),
    (["--arch=sebulba", "--env=Pong-v5", "stray"], "unexpected argument 'stray'"),
])
@pytest.mark.parametrize("mode", [[], ["--dry-run"], ["up"], ["--queued"]])
def test_a_training_flag_mistake_is_one_line_and_the_api_sees_no_call(
        cli, service, training, fragment, mode):
    verb = mode[0] if mode == ["up"] else None
    flags = [flag for flag in mode if flag != "up"]

    status, out, err = cli(*flags, *training, verb=verb)

    assert status == 2
    assert fragment in _single_error_line(err)
    assert out == ""
    assert service.requests == []  # every RPC of any service is recorded, answered or not


@pytest.mark.parametrize("typo, fragment", [
    ("--zonee=us-central2-b", "unknown flag --zonee; did you mean --zone (a provisioner flag)?"),
    ("--internal-ip", "did you mean --internal-ips (a provisioner flag)?"),
    (f"--service-acount={SERVICE_ACCOUNT}", "did you mean --service-account (a provisioner flag)?"),
    ("--sport", "did you mean --spot (a provisioner flag)?"),
    ("--subnet=tpu-sub", "did you mean --subnetwork (a provisioner flag)?"),
])
def test_a_mistyped_provisioner_flag_is_named_and_never_reaches_the_workers(
        cli, service, typo, fragment):
    status, out, err = cli(typo, *TRAINING)

    assert status == 2
    assert fragment in _single_error_line(err)
    assert service.requests == []


@pytest.mark.parametrize("flags, fragment", [
    (["--tags=podracer,Allow_SSH"], "--tags: 'Allow_SSH' is not a valid network tag"),
    (["--tags=" + "a" * 64], "is not a valid network tag"),
    (["--vpc-network=My_Net"], "--vpc-network='My_Net' is not valid"),
    (["--subnetwork=projects/p/regions/r/subnetworks/Bad_Sub"], "--subnetwork="),
    (["--service-account=trainer"], "--service-account='trainer' is not valid"),
    (["--scopes=cloud-platform"], "'cloud-platform' is not an OAuth scope URL"),
    (["--spot", "--reserved"], "argument --reserved: not allowed with argument --spot"),
])
def test_bad_network_and_identity_values_are_one_line_and_no_call(cli, service, flags, fragment):
    status, out, err = cli(*flags, *TRAINING)

    assert status == 2
    assert fragment in _single_error_line(err)
    assert service.requests == []


def test_the_server_records_a_call_to_a_method_it_does_not_serve(server, service):
    channel = grpc.insecure_channel(server.endpoint)
    try:
        with pytest.raises(grpc.RpcError) as raised:
            channel.unary_unary("/google.cloud.tpu.v2.Tpu/StopNode")(b"", timeout=5)
    finally:
        channel.close()
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert service.requests == [("/google.cloud.tpu.v2.Tpu/StopNode", None)]


def test_logs_reads_the_workers_logs_from_the_bucket_by_slice_name_or_run_dir(cli, service, gcs_bucket):
    service.worker_states = [["running"] * 4]
    status, out, err = cli(*TRAINING, verb="up")
    assert (status, err) == (0, "")
    run_dir = service.requests_of("CreateNode")[0].node.metadata[api_requests.RUN_DIR_KEY]
    logs = run_dir.removeprefix(BUCKET + "/") + "/logs/"
    # What two workers have copied so far, as `podracer.provision.worker` copies it.
    gcs_bucket.blob(logs + "worker-0.log").upload_from_string("installing\ntraining step 1\n")
    gcs_bucket.blob(logs + "worker-1.log").upload_from_string("installing\n")

    status, out, err = cli(NAME, verb="logs", slice_flags=False)
    assert (status, err) == (0, "")
    assert out.splitlines() == ["[worker 0] installing", "[worker 0] training step 1",
                                "[worker 1] installing"]

    status, out, err = cli(NAME, "--worker=1", verb="logs", slice_flags=False)
    assert (status, out, err) == (0, "installing\n", "")

    # --follow prints what is new until the worker has ended, then its status.
    gcs_bucket.blob(logs + "worker-0.log").upload_from_string("installing\ntraining step 1\ndone\n")
    gcs_bucket.blob(logs + "worker-0.exit").upload_from_string("0")
    status, out, err = cli(NAME, "--worker=0", "--follow", verb="logs", slice_flags=False)
    assert (status, out.splitlines()[-1], err) == (0, "done", "")

    status, out, err = cli(f"--tpu={NAME}", verb="down", slice_flags=False)
    assert status == 0 and service.nodes == {}
    # The slice is gone; its logs are not.
    status, out, err = cli(NAME, verb="logs", slice_flags=False)
    assert status == 2 and "logs gs://BUCKET/PATH" in _single_error_line(err)
    status, out, err = cli(run_dir, "--worker=1", verb="logs", slice_flags=False)
    assert (status, out, err) == (0, "installing\n", "")
    gcs_bucket.blob(logs + "worker-1.exit").upload_from_string("3")
    status, out, err = cli(run_dir, "--worker=1", "--follow", verb="logs", slice_flags=False)
    assert status == 1 and out.splitlines()[-1] == "worker 1 exited with status 3"


def test_the_end_of_a_run_prints_its_summary_from_the_bucket(cli, service, gcs_bucket):
    summary = {"arch": "sebulba", "algo": "ppo", "env": "Pong-v5", "env_steps": 50_000_000,
               "sps": 123_456.0, "episode_return_mean": 20.5, "processes": 4}
    gcs_bucket.blob("done-run/summary.json").upload_from_string(json.dumps(summary))

    status, out, err = cli(*TRAINING, f"--run-dir={BUCKET}/done-run")

    assert (status, err) == (0, "")
    assert f"results in {BUCKET}/done-run:" in out
    assert "sebulba ppo on Pong-v5: 50,000,000 env steps at 123,456 env steps/s over 4 processes" in out
    assert "episode return (mean of the last interval): 20.50" in out
    assert f"python -m podracer.plot {BUCKET}/done-run" in out
    assert service.nodes == {}


def _launch_record(gcs_bucket, service) -> dict:
    run_dir = service.requests_of("CreateNode")[0].node.metadata[api_requests.RUN_DIR_KEY]
    blob = gcs_bucket.blob(run_dir.removeprefix(BUCKET + "/") + "/launch.json")
    return json.loads(blob.download_as_text())


def test_preempt_with_restarts_left_creates_the_slice_again_and_records_it(cli, service, gcs_bucket):
    service.node_states = [NodeState.CREATING, NodeState.READY, NodeState.READY, NodeState.PREEMPTED]
    service.worker_states = [["running"] * 4] * 3 + [["exit=0"] * 4]
    creates = []

    def second_slice_is_not_preempted():
        creates.append(1)
        if len(creates) == 2:
            service.node_states = [NodeState.CREATING, NodeState.READY]

    service.on_call("CreateNode", second_slice_is_not_preempted)
    status, out, err = cli("--max-restarts=1", *TRAINING)

    assert (status, err) == (0, "")
    assert service.methods_called().count("CreateNode") == 2
    assert service.methods_called().count("DeleteNode") == 2  # the preempted one, then the finished one
    assert "was PREEMPTED during the run; restart 1 of 1" in out and service.nodes == {}
    first, second = service.requests_of("CreateNode")
    # The same slice, asked for again; each create has its own launch id.
    assert first.node.metadata["startup-script"] == second.node.metadata["startup-script"]
    assert (first.node.labels[api_requests.LAUNCH_ID_LABEL]
            != second.node.labels[api_requests.LAUNCH_ID_LABEL])
    record = _launch_record(gcs_bucket, service)
    assert [restart["reason"] for restart in record["restarts"]] == [
        "TPU slice-1 was PREEMPTED during the run"]


def test_an_api_outage_longer_than_the_retry_deadline_never_deletes_a_training_slice(cli, service):
    service.worker_states = [["running"] * 4] * 3 + [["exit=0"] * 4]
    outages = []

    def outage():  # once the run is going: GetNode unavailable for a good while
        if not outages:
            outages.append(1)
            service.fail("GetNode", grpc.StatusCode.UNAVAILABLE, times=60)

    service.on_call("GetGuestAttributes", outage, after_effect=True)
    status, out, err = cli("--retry-deadline=0.2", *TRAINING)

    assert (status, err) == (0, "")
    assert "cannot reach the Cloud TPU API" in out and "the Cloud TPU API answers again" in out
    # Deleted once, at the end of the run, not during the outage.
    assert service.methods_called().count("DeleteNode") == 1
    assert service.methods_called()[-1] in ("DeleteNode", "GetOperation")


def test_repairing_then_ready_is_waited_out(cli, service):
    service.node_states = [NodeState.CREATING, NodeState.READY, NodeState.READY,
                           NodeState.REPAIRING, NodeState.REPAIRING, NodeState.READY]
    service.worker_states = [["running"] * 4] * 3 + [["exit=0"] * 4]

    status, out, err = cli(*TRAINING)

    assert (status, err) == (0, "")
    assert "TPU REPAIRING" in out and "workers: 4 exited 0" in out


def test_a_slice_unhealthy_for_good_is_lost_and_deleted(cli, service):
    service.node_states = [NodeState.CREATING, NodeState.READY, NodeState.READY] + [NodeState.REPAIRING] * 10_000
    service.worker_states = [["running"] * 4]

    status, out, err = cli("--repair-timeout=0.3", *TRAINING)

    assert status == 1
    line = _single_error_line(err)
    assert "stayed REPAIRING for 0.3 s" in line and "TPU slice-1 deleted" in line
    assert service.nodes == {}


def test_down_deletes_the_queued_resource_the_node_names_even_named_apart(cli, service):
    other = f"projects/{PROJECT}/locations/{ZONE}/queuedResources/qr-other"
    service.nodes[NODE] = service._new_node(NODE, tpu_v2.Node(), queued_resource=other)
    resource = tpu_v2.QueuedResource(name=other, tpu=tpu_v2.QueuedResource.Tpu(node_spec=[
        tpu_v2.QueuedResource.Tpu.NodeSpec(node_id=NAME)]))
    from tests.tpu_server import _Slot
    service.queued[other] = _Slot(resource)

    status, out, err = cli(NAME, verb="down", slice_flags=False)

    assert (status, err) == (0, "")
    (delete,) = service.requests_of("DeleteQueuedResource")
    assert delete.name == other and delete.force
    assert service.nodes == {} and service.queued == {}


def test_detach_leaves_the_run_and_attach_follows_it_to_the_end(cli, service, gcs_bucket):
    service.worker_states = [["running"] * 4] * 3 + [["exit=0"] * 4]

    status, out, err = cli("--detach", "--max-restarts=2", *TRAINING)
    assert (status, err) == (0, "")
    assert "detached: TPU slice-1 trains on" in out
    assert f"python launch/tpu.py attach {NAME} --zone={ZONE} --project={PROJECT}" in out
    assert list(service.nodes) == [NODE] and "DeleteNode" not in service.methods_called()
    config = _worker_config(service.requests_of("CreateNode")[0].node.metadata["startup-script"])
    # Without a launcher, the workers delete their finished slice themselves.
    assert config["delete_when_done"] == {"name": NAME, "zone": ZONE, "project": PROJECT,
                                          "api_endpoint": config["delete_when_done"]["api_endpoint"]}
    # --max-run-time travels as a duration: each worker counts it from its own training start.
    assert config["max_restarts"] == 2 and config["max_run_time_s"] == 60
    assert "deadline_unix" not in config

    status, out, err = cli(NAME, verb="attach", slice_flags=False)
    assert (status, err) == (0, "")
    assert "attached to the run in gs://podracer-runs/runs/slice-1-" in out
    assert "the run finished on every worker" in out and service.nodes == {}

    # Attaching again, by the run directory, once all is over: the workers' exit
    # statuses in the bucket say it finished.
    run_dir = _launch_record(gcs_bucket, service)["run_dir"]
    logs = run_dir.removeprefix(BUCKET + "/") + "/logs/"
    gcs_bucket.blob(logs + "worker-0.log").upload_from_string("done\n")
    gcs_bucket.blob(logs + "worker-0.exit").upload_from_string("0")
    status, out, err = cli(run_dir, verb="attach", slice_flags=False)
    assert (status, err) == (0, "") and "the run has finished and TPU slice-1 is gone" in out


def test_a_slice_its_workers_deleted_at_the_end_is_not_created_again(cli, service, gcs_bucket):
    service.worker_states = [["running"] * 4]
    done = []

    def workers_finish_and_delete_their_slice():
        if done:
            return
        done.append(1)
        run_dir = service.requests_of("CreateNode")[0].node.metadata[api_requests.RUN_DIR_KEY]
        logs = run_dir.removeprefix(BUCKET + "/") + "/logs/"
        for worker in range(4):
            gcs_bucket.blob(f"{logs}worker-{worker}.log").upload_from_string("done\n")
            gcs_bucket.blob(f"{logs}worker-{worker}.exit").upload_from_string("0")
        service.nodes.clear()  # worker 0's own `down`

    service.on_call("GetGuestAttributes", workers_finish_and_delete_their_slice, after_effect=True)
    status, out, err = cli("--max-restarts=3", *TRAINING)

    assert (status, err) == (0, "")
    assert "the run finished on every worker, and TPU slice-1 is gone" in out
    assert service.methods_called().count("CreateNode") == 1


def test_dry_run_on_v6e_8_accepts_sebulbas_defaults_and_names_the_slice(cli, service):
    status, out, err = cli("--dry-run", "--arch=sebulba", shape=("--accelerator-type=v6e-8",))

    assert (status, err) == (0, "")
    assert "# slice: v6e-8 (1 host of 8 devices), one process of the run per host" in out
    assert service.requests == []


@pytest.mark.parametrize("mode", [[], ["--dry-run"], ["up"]])
def test_a_layout_the_slice_cannot_run_is_refused_before_any_call(cli, service, mode):
    verb = mode[0] if mode == ["up"] else None
    flags = [flag for flag in mode if flag != "up"]

    status, out, err = cli(*flags, "--arch=sebulba", "--num-envs=100", verb=verb,
                           shape=("--accelerator-type=v6e-8",))

    assert status == 2 and out == ""
    assert _single_error_line(err) == (
        "error: on v6e-8 (1 host of 8 devices): each actor thread's 50 environments do not split "
        "over 6 learner devices; make --num-envs a multiple of 12\n")
    assert service.requests == []


def _staged(gcs_bucket, create, name: str) -> str:
    run_dir = create.node.metadata[api_requests.RUN_DIR_KEY]
    return gcs_bucket.blob(f"{run_dir.removeprefix(BUCKET + '/')}/code/{name}").download_as_text()


def test_a_brax_runs_staged_lock_lists_brax(cli, service, gcs_bucket):
    status, out, err = cli("--arch=anakin", "--env=brax:inverted_pendulum", "--num-envs=64")

    assert (status, err) == (0, "")
    (create,) = service.requests_of("CreateNode")
    locked = _staged(gcs_bucket, create, "requirements.lock").splitlines()
    assert any(line.startswith("brax==") for line in locked)


def test_a_py_envs_module_is_staged_beside_the_launcher(cli, service, gcs_bucket, tmp_path,
                                                         monkeypatch):
    (tmp_path / "my_sims.py").write_text(
        "import gymnasium\n\n\ndef make(num_envs):\n"
        "    return gymnasium.make_vec('CartPole-v1', num_envs=num_envs, vectorization_mode='sync')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # importable here, as the preflight checks it

    status, out, err = cli("--arch=sebulba", "--env=py:my_sims:make", "--num-envs=24")

    assert (status, err) == (0, "")
    (create,) = service.requests_of("CreateNode")
    config = _worker_config(create.node.metadata["startup-script"])
    assert config["files"]["module:my_sims.py"] == "my_sims.py"
    assert _staged(gcs_bucket, create, "my_sims.py") == (tmp_path / "my_sims.py").read_text()


def test_worker_states_are_read_by_worker_number_in_whatever_order_the_api_lists_them(cli, service):
    """The API names no worker in its answer; each worker publishes its number beside its state."""
    service.worker_states = [["running", "exit=0", "installing", None]]
    service.guest_attributes_unordered = True  # reversed, the silent worker 3 left out
    assert cli(*TRAINING, verb="up")[0] == 0

    status, out, err = cli(NAME, verb="status", slice_flags=False)

    assert (status, err) == (0, "")
    rows = [line.split()[:3] for line in out.splitlines() if line.startswith("  ") and "10.0.0." in line]
    assert rows == [["0", "10.0.0.2", "running"], ["1", "10.0.0.3", "exited"],
                    ["2", "10.0.0.4", "installing"], ["3", "10.0.0.5", "booting"]]


def test_max_run_time_counts_from_the_slice_being_ready_not_from_the_queue(cli, service, gcs_bucket):
    """Two seconds queued for capacity, then a run of well under one: a 1 s --max-run-time holds."""
    service.queued_states = [QueuedState.WAITING_FOR_RESOURCES] * 200 + [QueuedState.ACTIVE]
    service.worker_states = [["running"] * 4, ["exit=0"] * 4]
    started = time.time()

    status, out, err = cli("--queued", "--max-run-time=1", *TRAINING)

    assert (status, err) == (0, ""), out
    assert "the run finished on every worker" in out
    (create,) = service.requests_of("CreateQueuedResource")
    run_dir = create.queued_resource.tpu.node_spec[0].node.metadata[api_requests.RUN_DIR_KEY]
    record = json.loads(gcs_bucket.blob(f"{run_dir.removeprefix(BUCKET + '/')}/launch.json")
                        .download_as_text())
    assert record["max_run_time_s"] == 1 and record["deadline_unix"] > started + 2


def test_attach_restarts_a_detached_run_whose_slice_was_preempted_while_nobody_followed(
        cli, service, gcs_bucket):
    service.worker_states = [["running"] * 4]
    status, out, err = cli("--detach", "--max-restarts=1", *TRAINING)
    assert (status, err) == (0, "")
    service.nodes[NODE].script = []
    service.nodes[NODE].set_state(NodeState.PREEMPTED)  # the laptop was closed meanwhile

    def the_new_slice_runs_to_the_end():
        service.node_states = [NodeState.CREATING, NodeState.READY]
        service.worker_states = [["running"] * 4, ["exit=0"] * 4]

    service.on_call("CreateNode", the_new_slice_runs_to_the_end)
    status, out, err = cli(NAME, verb="attach", slice_flags=False)

    assert (status, err) == (0, ""), out
    assert service.methods_called().count("CreateNode") == 2
    assert "was PREEMPTED during the run; restart 1 of 1" in out
    assert "the run finished on every worker" in out and service.nodes == {}
    assert len(_launch_record(gcs_bucket, service)["restarts"]) == 1
