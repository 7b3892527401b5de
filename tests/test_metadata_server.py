"""The local metadata server answers as a TPU VM's does: to a stdlib client, to jax, to google-auth."""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.metadata_server import MetadataServer, worker_endpoints

FLAVOR = {"Metadata-Flavor": "Google"}


def fetch(mds, path, *, method="GET", data=None, headers=FLAVOR):
    request = urllib.request.Request(mds.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


def test_attributes_guest_attributes_and_token():
    attributes = {"agent-worker-number": "1",
                  "worker-network-endpoints": worker_endpoints(["10.0.0.2", "10.0.0.3"])}
    with MetadataServer(attributes) as mds:
        status, headers, body = fetch(mds, "instance/attributes/agent-worker-number")
        assert (status, body) == (200, "1")
        assert headers["Metadata-Flavor"] == "Google"
        assert fetch(mds, "instance/attributes/worker-network-endpoints")[2] == \
            "unknown:unknown:10.0.0.2,unknown:unknown:10.0.0.3"
        assert fetch(mds, "instance/attributes/no-such-key")[0] == 404

        # Without the header the real server refuses, and so does this one.
        assert fetch(mds, "instance/attributes/agent-worker-number", headers={})[0] == 403

        # Attributes change while it runs.
        mds.attributes["podracer-run"] = "gs://bucket/run"
        assert fetch(mds, "instance/attributes/podracer-run")[2] == "gs://bucket/run"

        assert fetch(mds, "instance/guest-attributes/podracer/state")[0] == 404
        status, _, _ = fetch(mds, "instance/guest-attributes/podracer/state", method="PUT",
                             data=b"installing")
        assert status == 200
        assert mds.guest_attributes == {"podracer/state": "installing"}
        assert fetch(mds, "instance/guest-attributes/podracer/state")[2] == "installing"
        assert fetch(mds, "instance/guest-attributes/no-namespace", method="PUT", data=b"x")[0] == 400

        status, headers, body = fetch(mds, "instance/service-accounts/default/token")
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert json.loads(body) == {"access_token": "test-access-token", "expires_in": 3599,
                                    "token_type": "Bearer"}

        mds.fail("instance/attributes/agent-worker-number", times=2)
        assert [fetch(mds, "instance/attributes/agent-worker-number")[0] for _ in range(3)] == \
            [503, 503, 200]

        refused = [r for r in mds.requests if not r.flavor]
        assert [(r.path, r.status) for r in refused] == \
            [("instance/attributes/agent-worker-number", 403)]
        puts = [r for r in mds.requests if r.method == "PUT"]
        assert [(r.path, r.body, r.status) for r in puts] == [
            ("instance/guest-attributes/podracer/state", "installing", 200),
            ("instance/guest-attributes/no-namespace", "x", 400)]
        assert mds.paths("GET").count("instance/attributes/agent-worker-number") == 4
    with pytest.raises(RuntimeError):
        mds.host


def test_jax_reads_the_tpu_vm_worker_attributes(monkeypatch):
    """jax's own Cloud TPU cluster code parses what the server holds (it reads GCE_METADATA_IP)."""
    from jax._src.clusters import cloud_tpu_cluster

    attributes = {"agent-worker-number": "1",
                  "worker-network-endpoints": worker_endpoints(["10.0.0.2", "10.0.0.3"])}
    with MetadataServer(attributes) as mds:
        monkeypatch.setenv("GCE_METADATA_IP", mds.host)
        assert cloud_tpu_cluster.GceTpuCluster._get_process_id_in_slice() == 1
        assert cloud_tpu_cluster.GceTpuCluster._get_worker_list_in_slice() == \
            ["10.0.0.2", "10.0.0.3"]
        assert cloud_tpu_cluster.get_metadata("agent-worker-number") == ("1", 200)


def test_google_auth_compute_engine_credentials_get_a_token():
    """google-auth's metadata client, pointed at the server by GCE_METADATA_HOST, refreshes a token."""
    with MetadataServer() as mds:
        program = (
            "import google.auth.compute_engine as ce, google.auth.transport.requests as tr\n"
            "c = ce.Credentials()\n"
            "c.refresh(tr.Request())\n"
            "print(c.token, c.service_account_email)\n")
        env = dict(os.environ, GCE_METADATA_HOST=mds.host, GCE_METADATA_IP=mds.host)
        out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["test-access-token", mds.email]
        assert "instance/service-accounts/default/token" in mds.paths("GET")
