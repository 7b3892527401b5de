"""`--run-dir=gs://BUCKET/PATH` end to end, against a local Cloud Storage emulator.

The emulator (gcp-storage-emulator, `tests/gcs_emulator.py`; the fixtures
`gcs_emulator` and `gcs_bucket` in conftest.py) serves one module's tests.
Every client reaches it through the variables it documents, set in this
process's environment for the launcher's subprocesses; podracer is not told.
The tests list and read the bucket with google-cloud-storage.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import GCS_BUCKET as BUCKET, LAUNCHER, PYTHON, REPO_ROOT

pytest.importorskip("google.cloud.storage")
pytest.importorskip("gcp_storage_emulator")
pytest.importorskip("gcsfs")

ANAKIN = ["--num-envs=16", "--rollout-len=16", "--updates-per-call=1", "--checkpoint-every=2048"]
ANAKIN_TOTAL = 30720  # 120 calls of 256 env steps: a few seconds, long enough to be killed mid-run
SEBULBA = ["--arch=sebulba", "--env=CartPole-v1", "--cpu-devices=2", "--num-envs=32", "--rollout-len=32",
           "--log-every=2", "--checkpoint-every=0", "--seed=1"]


def _launch(args, cwd, timeout=240, env=None):
    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, **(env or {})})


def _objects(bucket, prefix):
    """name -> (generation, size) of every object under `prefix`."""
    return {blob.name: (blob.generation, blob.size) for blob in bucket.list_blobs(prefix=prefix)}


def _checkpoints(bucket, prefix):
    """Steps of the complete checkpoints under `prefix` (on Cloud Storage orbax writes commit_success.txt last)."""
    pattern = re.compile(re.escape(prefix) + r"checkpoints/(\d+)/commit_success\.txt")
    return sorted(int(m.group(1)) for name in _objects(bucket, prefix) if (m := pattern.fullmatch(name)))


def _rows(bucket, name):
    return [json.loads(line) for line in bucket.blob(name).download_as_text().splitlines()]


def _first_line(result):
    return result.stdout.splitlines()[0] if result.stdout else ""


def _no_local_gs(*folders):
    for folder in folders:
        assert not os.path.lexists(os.path.join(folder, "gs:")), f"a local directory gs: in {folder}"


@pytest.fixture(scope="module")
def anakin_run(gcs_bucket, tmp_path_factory):
    """An Anakin PPO run in the bucket: killed (SIGKILL) after its first checkpoint, then resumed to the end."""
    cwd = str(tmp_path_factory.mktemp("anakin"))
    run_dir = f"gs://{BUCKET}/anakin"
    args = [*ANAKIN, f"--total-steps={ANAKIN_TOTAL}", f"--run-dir={run_dir}"]
    proc = subprocess.Popen([PYTHON, LAUNCHER, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, cwd=cwd, env=dict(os.environ))
    deadline = time.monotonic() + 120
    while not _checkpoints(gcs_bucket, "anakin/") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=30)
    killed = _checkpoints(gcs_bucket, "anakin/")
    assert killed, f"no checkpoint reached the bucket before the kill: {stderr[-2000:]}"
    resumed = _launch(args, cwd)
    return {"cwd": cwd, "run_dir": run_dir, "args": args, "killed": killed, "resumed": resumed}


def test_anakin_ppo_writes_to_the_bucket_and_resumes_after_a_kill(gcs_bucket, anakin_run, tmp_path):
    killed, resumed = anakin_run["killed"], anakin_run["resumed"]
    assert killed[-1] < ANAKIN_TOTAL, "the run ended before it was killed: nothing was resumed"
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming gs://{BUCKET}/anakin from env step {killed[-1]:,}" in _first_line(resumed)
    names = set(_objects(gcs_bucket, "anakin/"))
    assert {"anakin/metrics.jsonl", "anakin/summary.json"} <= names
    assert f"anakin/checkpoints/{ANAKIN_TOTAL}/commit_success.txt" in names
    assert [name for name in names if name.startswith("anakin/tensorboard/events.out.tfevents.")]
    assert not [name for name in names if ".write-test" in name or name.endswith(".tmp")]
    # One row per call of 256 env steps, those before the kill kept and none twice.
    steps = [row["env_steps"] for row in _rows(gcs_bucket, "anakin/metrics.jsonl")]
    assert steps == list(range(256, ANAKIN_TOTAL + 1, 256))
    summary = json.loads(gcs_bucket.blob("anakin/summary.json").download_as_text())
    assert summary["env_steps"] == ANAKIN_TOTAL and summary["resumed_from_env_steps"] == killed[-1]
    # The TensorBoard events in the bucket read back: the killed run's up to its checkpoint
    # (copied before it), then the resumed run's, so every step is there.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for blob in gcs_bucket.list_blobs(prefix="anakin/tensorboard/"):
        blob.download_to_filename(str(tmp_path / os.path.basename(blob.name)))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {event.step for event in events.Scalars("podracer/sps")} == set(range(256, ANAKIN_TOTAL + 1, 256))
    _no_local_gs(anakin_run["cwd"], REPO_ROOT)

    # Run again: finished, and the bucket is left exactly as it was.
    before = _objects(gcs_bucket, "anakin/")
    again = _launch(anakin_run["args"], anakin_run["cwd"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"gs://{BUCKET}/anakin is a finished run" in again.stdout
    assert _objects(gcs_bucket, "anakin/") == before


def test_sebulba_ppo_resumes_from_the_bucket_with_more_steps(gcs_bucket, tmp_path):
    run_dir = f"gs://{BUCKET}/sebulba"
    profiled = [*SEBULBA, "--profile", "--profile-trace-s=1"]  # the trace goes to the bucket too
    first = _launch([*profiled, "--total-steps=4096", f"--run-dir={run_dir}"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"new run in {run_dir}" in _first_line(first)
    assert _checkpoints(gcs_bucket, "sebulba/") == [4096]
    # The config check reads the bucket's checkpoint: a changed setting is refused in one line.
    changed = _launch([*profiled, "--total-steps=8192", "--lr=0.01", f"--run-dir={run_dir}"], tmp_path)
    assert changed.returncode == 2 and "made with another config: --lr" in changed.stderr
    # A save cut short by a kill: on Cloud Storage orbax writes into the step's own directory
    # and commit_success.txt last. Such a step is not a checkpoint to resume from.
    gcs_bucket.blob("sebulba/checkpoints/6144/_CHECKPOINT_METADATA").upload_from_string("{}")
    second = _launch([*profiled, "--total-steps=8192", f"--run-dir={run_dir}"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming {run_dir} from env step 4,096" in _first_line(second)
    assert [row["env_steps"] for row in _rows(gcs_bucket, "sebulba/metrics.jsonl")] == [2048, 4096, 6144, 8192]
    summary = json.loads(gcs_bucket.blob("sebulba/summary.json").download_as_text())
    assert summary["env_steps"] == 8192 and summary["resumed_from_env_steps"] == 4096
    trace = summary["profile"]["trace_file"]
    assert trace.startswith(f"{run_dir}/profile/plugins/profile/") and trace.endswith(".xplane.pb")
    assert gcs_bucket.blob(trace[len(f"gs://{BUCKET}/"):]).exists()
    assert [b.name for b in gcs_bucket.list_blobs(prefix="sebulba/tensorboard/")]
    _no_local_gs(str(tmp_path), REPO_ROOT)


def test_policy_eval_and_plot_read_the_bucket(gcs_bucket, anakin_run, tmp_path):
    run_dir = anakin_run["run_dir"]
    # load_policy from the bucket acts as the trained policy (a random CartPole policy scores ~22).
    code = ("import json, podracer; from podracer.evaluate import gymnax_returns; "
            f"act = podracer.load_policy({run_dir!r}, deterministic=True); "
            "print(json.dumps(float(gymnax_returns(act, 'CartPole-v1', 8).mean())))")
    loaded = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=240,
                            cwd=tmp_path, env=dict(os.environ))
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert json.loads(loaded.stdout.splitlines()[-1]) > 100

    evaluated = _launch(["eval", f"--run-dir={run_dir}", "--episodes=4"], tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout.splitlines()[-1])["episodes"] == 4

    out = tmp_path / "local.png"
    plotted = subprocess.run([PYTHON, "-m", "podracer.plot", run_dir, "--out", str(out)], capture_output=True,
                             text=True, timeout=240, cwd=tmp_path, env=dict(os.environ))
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _no_local_gs(str(tmp_path), REPO_ROOT)


def test_a_bucket_run_keeps_its_compiled_programs_beside_it_in_the_bucket(gcs_bucket, tmp_path):
    """No cache named: a gs:// run directory's programs go to compile_cache/ beside it, and come back."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("PODRACER_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    summaries = []
    for name in ("first", "again"):
        args = ["--num-envs=8", "--rollout-len=16", "--updates-per-call=2", "--total-steps=1024",
                "--checkpoint-every=0", f"--run-dir=gs://{BUCKET}/cached/{name}"]
        result = subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True, timeout=240,
                                cwd=tmp_path, env={**environ, "HOME": str(tmp_path)})
        assert result.returncode == 0, result.stderr[-3000:]
        summaries.append(json.loads(gcs_bucket.blob(f"cached/{name}/summary.json").download_as_text()))
    first, again = (summary["compile_cache"] for summary in summaries)
    assert first["dir"] == again["dir"] == f"gs://{BUCKET}/cached/compile_cache"
    assert not first["hit"] and first["misses"] >= 2
    assert again == {**first, "hit": True, "hits": first["misses"], "misses": 0}
    assert len(_objects(gcs_bucket, "cached/compile_cache/")) == first["misses"]
    assert not (tmp_path / ".cache").exists()  # nothing in the local default


def test_bucket_without_gcsfs_is_one_line_before_compiling(gcs_bucket, tmp_path):
    code = ("import sys; sys.modules['gcsfs'] = None; "  # as if the gcs extra were not installed
            "from podracer.orchestrate.cli import main; "
            f"sys.exit(main(['--total-steps=2048', '--run-dir=gs://{BUCKET}/nogcsfs']))")
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=dict(os.environ))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "podracer-rl[gcs]" in lines[0] and "gs://" in lines[0], result.stderr
    assert "compiling" not in result.stdout
    assert not _objects(gcs_bucket, "nogcsfs/")
    _no_local_gs(str(tmp_path))


def test_a_missing_bucket_is_one_line(gcs_bucket, tmp_path):
    result = _launch(["--total-steps=2048", "--run-dir=gs://no-such-bucket/run"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: cannot write to --run-dir=gs://no-such-bucket/run (no such bucket); pass a bucket and path "
        "you can write to (and check your Google Cloud credentials)")
    assert "Traceback" not in result.stderr
    _no_local_gs(str(tmp_path))


ES = {"anakin": (3200, ["--population=8", "--generations-per-call=2", "--eval-episodes=2", "--horizon=50",
                        "--checkpoint-every=800"]),
      "sebulba": (1500, ["--population=8", "--eval-episodes=2", "--checkpoint-every=300"])}


@pytest.mark.parametrize("arch", list(ES))
def test_es_writes_to_the_bucket(gcs_bucket, tmp_path, arch):
    """The other pairs share the session: the same outputs reach the bucket (and W&B stays local)."""
    run_dir = f"gs://{BUCKET}/{arch}-es"
    total, flags = ES[arch]
    args = ["--algo=es", f"--arch={arch}", *flags, f"--total-steps={total}", f"--run-dir={run_dir}", "--wandb"]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    result = subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    prefix = f"{arch}-es/"
    names = set(_objects(gcs_bucket, prefix))
    assert {prefix + "metrics.jsonl", prefix + "summary.json"} <= names
    assert [name for name in names if name.startswith(prefix + "tensorboard/events.out.tfevents.")]
    assert _checkpoints(gcs_bucket, prefix)[-1] >= total
    steps = [row["env_steps"] for row in _rows(gcs_bucket, prefix + "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] >= total
    assert list((tmp_path / "wandb").glob("offline-run-*"))  # W&B's own default: ./wandb
    _no_local_gs(str(tmp_path), REPO_ROOT)


DATASET = f"gs://{BUCKET}/datasets/cartpole"
RECORD_EPISODES = 4


def _tmpdir(root):
    """A TMPDIR for a subprocess: the local copies of a dataset must not stay in it."""
    folder = root / "tmp"
    folder.mkdir()
    return folder


def _left_copies(tmpdir):
    return [name for name in os.listdir(tmpdir) if name.startswith("podracer-dataset-")]


@pytest.fixture(scope="module")
def recorded(gcs_bucket, tmp_path_factory):
    """An Anakin PPO run (local run directory) that records its policy into the bucket."""
    cwd = tmp_path_factory.mktemp("record")
    tmpdir = _tmpdir(cwd)
    result = _launch([*ANAKIN, "--total-steps=2048", f"--run-dir={cwd / 'run'}", f"--record-dataset={DATASET}",
                      f"--record-episodes={RECORD_EPISODES}", "--record-deterministic"], cwd,
                     env={"TMPDIR": str(tmpdir)})
    assert result.returncode == 0, result.stderr[-3000:]
    return {"cwd": cwd, "tmpdir": tmpdir, "summary": json.loads((cwd / "run" / "summary.json").read_text())}


def test_record_dataset_into_the_bucket_reads_back(gcs_bucket, recorded, tmp_path):
    from podracer import data

    summary = recorded["summary"]
    assert summary["dataset_dir"] == DATASET and summary["dataset_episodes"] == RECORD_EPISODES
    names = {name.rsplit("/", 1)[1] for name in _objects(gcs_bucket, "datasets/cartpole/")}
    assert {"dataset_info.json", "features.json", "metadata.json"} <= names
    assert "podracer_episodes-train.array_record-00000" in names
    assert not _left_copies(recorded["tmpdir"])
    # The public reader, from the bucket, in a process of its own (the clients' variables
    # as the launcher's): what the run reported, CartPole's reward being 1 per step. And
    # the check a run makes before anything is built: the directory is taken.
    code = ("import json; from podracer import data; from podracer.errors import PodracerError\n"
            "from podracer.data.train_hooks import check_data_config\n"
            f"b = data.load_episodes({DATASET!r})\n"
            "refused = None\n"
            "try:\n"
            f"    check_data_config(data.DataConfig(record_dataset={DATASET!r}))\n"
            "except PodracerError as error:\n"
            "    refused = str(error)\n"
            "print(json.dumps({'lengths': b.metadata['episode_length'].tolist(), "
            "'obs': float(b.steps['observation'].sum()), 'refused': refused, "
            f"'env': data.dataset_metadata({DATASET!r})['env']}}))")
    tmpdir = _tmpdir(tmp_path)
    read = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env={**os.environ, "TMPDIR": str(tmpdir)})
    assert read.returncode == 0, read.stderr[-3000:]
    got = json.loads(read.stdout.splitlines()[-1])
    assert len(got["lengths"]) == RECORD_EPISODES and got["env"] == "CartPole-v1"
    assert got["refused"] == f"{DATASET} already exists and is not empty; record into a new or empty directory"
    assert sum(got["lengths"]) == pytest.approx(RECORD_EPISODES * summary["dataset_return_mean"])
    assert not _left_copies(tmpdir)
    # The objects themselves, fetched by google-cloud-storage, are that dataset.
    copy = tmp_path / "copy"
    copy.mkdir()
    for blob in gcs_bucket.list_blobs(prefix="datasets/cartpole/"):
        blob.download_to_filename(str(copy / blob.name.rsplit("/", 1)[1]))
    local = data.load_episodes(str(copy))
    assert local.metadata["episode_length"].tolist() == got["lengths"]
    assert float(local.steps["observation"].sum()) == pytest.approx(got["obs"])
    assert float(local.metadata["episode_return"].mean()) == pytest.approx(summary["dataset_return_mean"])
    _no_local_gs(str(recorded["cwd"]), str(tmp_path), REPO_ROOT)


def test_init_from_dataset_in_the_bucket_clones_it(gcs_bucket, recorded, tmp_path):
    tmpdir = _tmpdir(tmp_path)
    # The recording run's flags: its compiled training program is reused.
    result = _launch([*ANAKIN, "--total-steps=2048", f"--run-dir={tmp_path / 'run'}",
                      f"--init-from-dataset={DATASET}", "--bc-steps=200"], tmp_path, env={"TMPDIR": str(tmpdir)})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # Every acting step of the recording, cloned far better than chance (log 1/2 = -0.69):
    # its actions are the deterministic ones of the recorded policy.
    recorded_steps = RECORD_EPISODES * recorded["summary"]["dataset_return_mean"]
    assert summary["bc_steps"] == 200 and summary["bc_demonstrations"] == pytest.approx(recorded_steps)
    assert summary["bc_log_likelihood"] > -0.4, summary["bc_log_likelihood"]
    assert not _left_copies(tmpdir)
    _no_local_gs(str(tmp_path), REPO_ROOT)


def test_a_failed_dataset_upload_keeps_the_local_copy(gcs_emulator, tmp_path):
    code = ("import numpy as np; from podracer import data; from podracer.errors import PodracerError\n"
            "writer = data.DatasetWriter('gs://no-such-bucket/ds', data.step_spec((4,), np.float32, (), np.int32))\n"
            "writer.add_episode({'observation': np.ones((3, 4)), 'action': np.zeros(3, np.int32), "
            "'reward': np.ones(3), 'discount': np.ones(3), 'is_terminal': np.zeros(3, bool), "
            "'policy_log_prob': np.zeros(3)})\n"
            "try:\n    writer.close()\nexcept PodracerError as error:\n    print(error)\n")
    tmpdir = _tmpdir(tmp_path)
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                            env={**os.environ, "TMPDIR": str(tmpdir)})
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = result.stdout.strip().splitlines()
    [kept] = _left_copies(tmpdir)
    assert line == (f"could not upload the dataset to gs://no-such-bucket/ds (no such bucket); it is kept in "
                    f"{tmpdir / kept}: copy it with `gcloud storage rsync -r {tmpdir / kept} gs://no-such-bucket/ds`")
    from podracer import data

    assert data.load_episodes(str(tmpdir / kept)).metadata["episode_length"].tolist() == [2]


def test_upload_tree_sends_the_dataset_description_last(tmp_path, monkeypatch):
    """A dataset whose upload is cut short has no dataset_info.json in the bucket: it is not one."""
    from podracer import storage as files

    for relative in ("dataset_info.json", "features.json", "a.array_record-00000", "sub/z.json"):
        (tmp_path / relative).parent.mkdir(exist_ok=True)
        (tmp_path / relative).write_text(relative)
    sent = []
    monkeypatch.setattr(files, "upload", lambda local, remote: sent.append((local, remote)))
    assert files.upload_tree(str(tmp_path), "gs://b/ds", last=("dataset_info.json",)) == 4
    assert sent[-1] == (str(tmp_path / "dataset_info.json"), "gs://b/ds/dataset_info.json")
    assert sorted(sent[:-1]) == [(str(tmp_path / name), f"gs://b/ds/{name}")
                                 for name in ("a.array_record-00000", "features.json", "sub/z.json")]
