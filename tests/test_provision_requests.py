"""Pure parts of the provisioner: flag parsing, request building, reports, git URLs."""

import sys

import pytest

pytest.importorskip("google.cloud.tpu_v2", reason="needs the tpu extra")
from google.cloud import tpu_v2

from podracer.errors import PodracerError
from podracer.provision import api_requests as requests
from podracer.provision.api import is_loopback
from podracer.command import main  # the front door: `python launch/tpu.py ...`
from podracer.provision.cli import check_command, parse_command, provisioner_flags
from podracer.provision.report import describe_workers, list_table
from podracer.provision.spec import (TPU_VERSIONS, Identity, Networking, SliceSpec,
                                     default_runtime_version)
from podracer.provision.validate import TOPOLOGY_DIMENSIONS
from podracer.provision.startup import WorkerState

SLICE = ["--tpu=slice-1", "--zone=us-central2-b", "--accelerator-type=v4-32", "--bucket=gs://bkt"]


def test_flags_not_the_provisioners_and_everything_after_dashes_are_training_flags_in_order():
    command = parse_command([
        "up", *SLICE, "--arch=sebulba", "--lr", "3e-4", "--keep", "--keep-checkpoints", "2",
        "--hidden", "64", "64", "--", "--seed=3", "--total-steps=1000",
    ])
    assert command.verb == "up"
    assert command.keep is True
    assert command.spec.zone == "us-central2-b"
    assert command.training_flags == (
        "--arch=sebulba", "--lr", "3e-4", "--keep-checkpoints", "2", "--hidden", "64", "64",
        "--seed=3", "--total-steps=1000",
    )
    check_command(command)  # the trainer's parser takes them all


def test_the_provisioner_and_the_trainer_share_no_flag_but_help():
    from podracer.provision.preflight import training_flag_names

    shared = set(provisioner_flags("run")) & set(training_flag_names(["--arch=sebulba"]))
    assert shared == {"--help"}


def test_no_verb_means_run_and_defaults_fill_in():
    command = parse_command([*SLICE, "--project=p", "--spot", "--queued"])
    assert command.verb == "run"
    assert command.spec == SliceSpec(
        project="p", zone="us-central2-b", name="slice-1", accelerator_type="v4-32",
        runtime_version="tpu-ubuntu2204-base", spot=True, queued=True)
    assert command.timing.poll_interval == 10.0
    assert command.training_flags == ()


def test_status_and_down_take_the_name_as_gcloud_does():
    assert parse_command(["status", "slice-7", "--zone=z1"]).spec.name == "slice-7"
    assert parse_command(["down", "--tpu=slice-8", "--zone=z1"]).spec.name == "slice-8"


@pytest.mark.parametrize("argv, fragment", [
    (["up", "--zone=z"], "needs --tpu, --accelerator-type"),
    (["list"], "needs --zone"),
    (["list", "--zone=z", "--arch=sebulba"], "unexpected argument '--arch=sebulba'"),
    ([*SLICE, "--spot", "--reserved"], "not allowed with argument"),
    (["--tpu=Bad_Name", "--zone=z", "--accelerator-type=v4-8"], "--tpu='Bad_Name' is not valid"),
    (["--tpu=a", "--zone=z/../x", "--accelerator-type=v4-8"], "--zone='z/../x' is not valid"),
    (["--tpu=a", "--zone=z", "--accelerator-type=v9-8"], "pass --runtime-version"),
    ([*SLICE, "--poll-interval=0"], "must be more than 0 seconds"),
    (["list", "--zone=z", "--zonee=y"], "did you mean --zone (a provisioner flag)?"),
    (["--tpu=a", "--zone=z"], "needs --accelerator-type (or --tpu-version with --topology)"),
    ([*SLICE, "--tpu-version=v4", "--topology=2x2x4"], "pass one: --accelerator-type=v4-32, or"),
    (["--tpu=a", "--zone=z", "--topology=2x2x4"], "--tpu-version is missing"),
    (["--tpu=a", "--zone=z", "--tpu-version=v4"], "--topology is missing"),
    (["--tpu=a", "--zone=z", "--tpu-version=v9", "--topology=2x2"], "invalid choice: 'v9'"),
    (["--tpu=a", "--zone=z", "--tpu-version=v4", "--topology=2x2"], "v4 chips are laid out in 3"),
    (["--tpu=a", "--zone=z", "--tpu-version=v6e", "--topology=2x2x2"], "laid out in 2"),
    (["--tpu=a", "--zone=z", "--tpu-version=v4", "--topology=2x0x2"], "--topology='2x0x2' is not"),
    (["--tpu=a", "--zone=z", "--tpu-version=v4", "--topology=2*2*2"], "--topology='2*2*2' is not"),
    (["--tpu=a", "--zone=z", "--accelerator-type=v4"], "--accelerator-type='v4' is not valid"),
    # Known before paying: under these scopes the workers cannot write the run's bucket.
    (["--tpu=a", "--zone=z", "--accelerator-type=v4-8",
      "--scopes=https://www.googleapis.com/auth/devstorage.read_only"],
     "do not let the workers write the run's bucket (checkpoints, metrics, logs); add "
     "https://www.googleapis.com/auth/devstorage.read_write"),
])
def test_bad_commands_are_one_line_errors_with_exit_2(argv, fragment, capsys):
    with pytest.raises(PodracerError) as raised:
        parse_command(argv)
    assert fragment in str(raised.value)

    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and err.count("\n") == 1
    assert fragment in err
    assert "Traceback" not in err and out == ""


def test_help_exits_0(capsys):
    assert main(["up", "--help"]) == 0
    assert "--accelerator-type" in capsys.readouterr().out


@pytest.mark.parametrize("accelerator, image", [
    ("v4-32", "tpu-ubuntu2204-base"),
    ("v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v5p-8", "v2-alpha-tpuv5"),
    ("v6e-8", "v2-alpha-tpuv6e"),
    ("v99-8", None),
])
def test_default_runtime_version(accelerator, image):
    assert default_runtime_version(accelerator) == image


def _spec(**overrides) -> SliceSpec:
    fields = dict(project="p", zone="us-central2-b", name="s", accelerator_type="v4-32",
                  runtime_version="tpu-ubuntu2204-base")
    return SliceSpec(**{**fields, **overrides})


def test_node_request_carries_type_image_tier_script_and_labels():
    spec = _spec(spot=True)
    request = requests.create_node_request(
        spec, requests.make_node(spec, "#!/bin/bash\n", "id1", "gs://b/run"))
    assert request.parent == "projects/p/locations/us-central2-b"
    assert request.node_id == "s"
    node = request.node
    assert (node.accelerator_type, node.runtime_version) == ("v4-32", "tpu-ubuntu2204-base")
    assert node.scheduling_config.spot and not node.scheduling_config.reserved
    assert node.metadata["startup-script"] == "#!/bin/bash\n"
    assert node.metadata[requests.RUN_DIR_KEY] == "gs://b/run"
    assert node.labels[requests.LAUNCH_ID_LABEL] == "id1"


def test_shape_and_network_values_are_read_as_gcloud_reads_them():
    command = parse_command([
        "--tpu=s", "--zone=z", "--tpu-version=V5P", "--topology=2X2X1", "--tags=a,b", "--tags=a",
        "--scopes", "https://www.googleapis.com/auth/devstorage.read_write",
        "--vpc-network=projects/host/global/networks/shared-net", "--internal-ips"])
    spec = command.spec
    assert (spec.accelerator_type, spec.tpu_version, spec.topology) == ("", "v5p", "2x2x1")
    assert spec.runtime_version == "v2-alpha-tpuv5"
    assert spec.networking == Networking(network="projects/host/global/networks/shared-net",
                                         external_ips=False, tags=("a", "b"))
    # Scopes without a service account: Compute Engine's default account, these scopes.
    assert spec.identity == Identity(scopes=("https://www.googleapis.com/auth/devstorage.read_write",))
    assert parse_command([*SLICE, "--accelerator-type=V4-8"]).spec.accelerator_type == "v4-8"
    assert parse_command(SLICE).spec.identity == Identity()


def test_every_tpu_version_has_an_api_type_an_image_and_a_topology_rank():
    for version in TPU_VERSIONS:
        spec = _spec(accelerator_type="", tpu_version=version, topology="1x1")
        assert requests.accelerator_config(spec).type_.name.replace("_", "").lower() == version
        assert default_runtime_version(version)
    assert set(TOPOLOGY_DIMENSIONS) == set(TPU_VERSIONS)


def test_node_network_defaults_to_external_ips_and_sends_no_identity_unless_given():
    node = requests.make_node(_spec(), "script", "id1", "gs://b/run")
    assert node.network_config == tpu_v2.NetworkConfig(enable_external_ips=True)
    assert "service_account" not in node and "scheduling_config" not in node
    internal = _spec(networking=Networking(external_ips=False, tags=("t1",)),
                     identity=Identity("sa@p.iam.gserviceaccount.com", ("https://x/y",)))
    node = requests.make_node(internal, "script", "id1", "gs://b/run")
    assert not node.network_config.enable_external_ips and list(node.tags) == ["t1"]
    assert node.service_account.email == "sa@p.iam.gserviceaccount.com"
    assert list(node.service_account.scope) == ["https://x/y"]


def test_queued_reserved_names_the_projects_reservations_and_leaves_the_node_tierless():
    spec = _spec(reserved=True, queued=True)
    request = requests.create_queued_resource_request(
        spec, requests.make_node(spec, "script", "id1", "gs://b/run"), 60.0, request_id="r-1")
    resource = request.queued_resource
    assert resource.reservation_name == "projects/p/locations/us-central2-b/reservations/-"
    assert "scheduling_config" not in resource.tpu.node_spec[0].node
    plain = requests.make_node(_spec(reserved=True), "script", "id1", "gs://b/run")
    assert plain.scheduling_config == tpu_v2.SchedulingConfig(reserved=True)


def test_queued_request_puts_spot_on_the_tier_and_expires_with_the_ready_timeout():
    spec = _spec(spot=True, queued=True)
    node = requests.make_node(spec, "script", "id1", "gs://b/run")
    request = requests.create_queued_resource_request(spec, node, 1800.0, request_id="r-1")
    resource = request.queued_resource
    assert request.queued_resource_id == "s" and request.request_id == "r-1"
    assert "spot" in resource and not resource.tpu.node_spec[0].node.scheduling_config.spot
    assert resource.queueing_policy.valid_until_duration.total_seconds() == 1800
    assert resource.tpu.node_spec[0].node_id == "s"


def test_delete_of_a_queued_slice_forces_its_node_away():
    assert requests.delete_request(_spec(queued=True)) == tpu_v2.DeleteQueuedResourceRequest(
        name="projects/p/locations/us-central2-b/queuedResources/s", force=True)
    assert requests.delete_request(_spec()) == tpu_v2.DeleteNodeRequest(
        name="projects/p/locations/us-central2-b/nodes/s")


def test_rpc_names():
    assert requests.rpc_name(tpu_v2.CreateNodeRequest()) == "google.cloud.tpu.v2.Tpu/CreateNode"
    assert (requests.rpc_name(tpu_v2.GetGuestAttributesRequest())
            == "google.cloud.tpu.v2.Tpu/GetGuestAttributes")


@pytest.mark.parametrize("endpoint, loopback", [
    ("127.0.0.1:8470", True), ("localhost:1234", True), ("[::1]:99", True),
    ("127.5.5.5:1", True), ("tpu.googleapis.com:443", False), ("10.0.0.1:80", False),
])
def test_is_loopback(endpoint, loopback):
    assert is_loopback(endpoint) is loopback


def test_describe_workers_counts_states():
    states = [WorkerState("running"), WorkerState("exited", 0), WorkerState("running")]
    assert describe_workers(states) == "2 running, 1 exited 0"


def test_list_table_shows_nodes_and_waiting_queued_resources_once():
    node = tpu_v2.Node(name="projects/p/locations/z/nodes/a", accelerator_type="v4-8",
                       state=tpu_v2.Node.State.READY, runtime_version="img",
                       queued_resource="projects/p/locations/z/queuedResources/a")
    active = tpu_v2.QueuedResource(name="projects/p/locations/z/queuedResources/a",
                                   tpu={"node_spec": [{"node_id": "a"}]})
    waiting = tpu_v2.QueuedResource(
        name="projects/p/locations/z/queuedResources/b",
        tpu={"node_spec": [{"node_id": "b", "node": {"accelerator_type": "v4-32"}}]},
        state={"state": tpu_v2.QueuedResourceState.State.WAITING_FOR_RESOURCES})
    table = list_table([node], [active, waiting])
    assert table[0].split() == ["NAME", "ACCELERATOR", "STATE", "RUNTIME", "QUEUED"]
    assert [row.split() for row in table[1:]] == [
        ["a", "v4-8", "READY", "img", "yes"],
        ["b", "v4-32", "WAITING_FOR_RESOURCES", "-", "yes"],
    ]


def test_without_the_tpu_extra_the_error_says_how_to_install_it(monkeypatch, capsys):
    import podracer.provision as package

    needs_extra = [name for name in sys.modules if name.startswith("podracer.provision.")
                   and name.rsplit(".", 1)[1] not in ("cli", "spec", "startup")]
    for name in needs_extra:
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.delattr(package, name.rsplit(".", 1)[1], raising=False)
    monkeypatch.setitem(sys.modules, "google.cloud.tpu_v2", None)
    monkeypatch.delattr(sys.modules["google.cloud"], "tpu_v2", raising=False)

    assert main(["list", "--zone=us-central2-b", "--project=p"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "needs google.cloud.tpu_v2" in err and 'pip install "podracer-rl[tpu]"' in err


def test_every_provisioner_flag_is_in_the_docs_flags_table():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "tpu.md").read_text()
    table = page.split("\n## Flags", 1)[1].split("\n## ", 1)[0]
    missing = [flag for flag in provisioner_flags("run")
               if flag != "--help" and f"`{flag}" not in table and f" {flag}=" not in table]
    assert missing == []
