"""The scoped profiler: attribution, overhead correction, the trace, and `--profile` end to end."""

import glob
import json
import os
import subprocess
import threading
import time

import jax
import numpy as np
import pytest

from conftest import LAUNCHER, PYTHON
from podracer.session import profile
from podracer.session.profile import OTHER, Profiler, format_profile
from podracer.session.trace import device_planes_busy

TICK = 1e-6


def _rows(report, role):
    return {row["operation"]: row for row in report["operations"] if row["thread"] == role}


def test_sleeps_are_attributed_to_their_operation_and_thread():
    # Two threads of one role (numbered names) and the main thread, each with
    # sleeps, some measured and some not. On a busy machine a sleep overruns,
    # so the truth is what each sleep took, timed by the workload itself.
    rounds, a_s, b_s, idle_s, main_s = 8, 0.03, 0.01, 0.01, 0.25
    truth = {"a": 0.0, "b": 0.0, "idle": 0.0, "c": 0.0}
    lock = threading.Lock()

    def sleep(kind, seconds):
        start = time.perf_counter()
        time.sleep(seconds)
        with lock:
            truth[kind] += time.perf_counter() - start

    profiler = Profiler()
    profiler.start()

    def worker():
        for _ in range(rounds):
            with profiler.measure("a"):
                sleep("a", a_s)
            with profiler.measure("b"):
                sleep("b", b_s)
            sleep("idle", idle_s)  # unmeasured: must land in the role's "other"

    threads = [threading.Thread(target=worker, name=f"worker-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    with profiler.measure("c"):
        sleep("c", main_s)
    for thread in threads:
        thread.join()
    report = profiler.stop()

    workers, main = _rows(report, "worker"), _rows(report, "main")
    assert report["roles"]["worker"]["threads"] == 2 and report["roles"]["main"]["threads"] == 1
    assert truth["a"] >= 2 * rounds * a_s and truth["c"] >= main_s
    for name in ("a", "b"):
        assert workers[name]["seconds"] == pytest.approx(truth[name], rel=0.1)
        assert workers[name]["calls"] == 2 * rounds
    assert main["c"]["seconds"] == pytest.approx(truth["c"], rel=0.1) and main["c"]["calls"] == 1
    # Each share is of the role's threads x wall; the unmeasured sleeps are in "other".
    wall = report["wall_s"]
    assert workers["a"]["share"] == pytest.approx(truth["a"] / (2 * wall), rel=0.1)
    assert main["c"]["share"] == pytest.approx(truth["c"] / wall, rel=0.1)
    assert workers[OTHER]["seconds"] >= 0.9 * truth["idle"]
    assert workers[OTHER]["seconds"] == pytest.approx(2 * wall - truth["a"] - truth["b"], rel=0.1)
    for role in ("worker", "main"):  # each role's rows, "other" included, make up its time
        assert sum(row["share"] for row in _rows(report, role).values()) == pytest.approx(1.0)
    table = format_profile(report)
    assert "worker x2" in table and "other (unmeasured)" in table


class FakeClock:
    """A clock that every read moves on by one tick: instrumentation with a known cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += TICK
        return self.now

    def work(self, ticks):
        self.now += ticks * TICK


def test_overhead_correction_recovers_the_true_work(monkeypatch):
    # Each measure() reads the clock twice: one tick inside the operation's own
    # window, two ticks per call in all. The work is 10 ticks a call.
    clock = FakeClock()
    monkeypatch.setattr(profile, "clock", clock)
    calls, work = 5000, 10
    profiler = Profiler()
    profiler.start()
    assert profiler.overhead.inside_s == pytest.approx(TICK)
    assert profiler.overhead.per_call_s == pytest.approx(2 * TICK)
    for _ in range(calls):
        with profiler.measure("tiny"):
            clock.work(work)
    report = profiler.stop()

    tiny = _rows(report, "main")["tiny"]
    true_s = calls * work * TICK
    assert tiny["raw_seconds"] == pytest.approx(calls * (work + 1) * TICK)  # uncorrected: 10 % more
    assert tiny["seconds"] == pytest.approx(true_s)
    assert report["wall_s"] == pytest.approx(calls * (work + 2) * TICK, abs=2 * TICK)
    assert report["overhead_correction_s"] == pytest.approx(calls * 2 * TICK)
    assert report["overhead_share"] == pytest.approx(2 / 12, rel=1e-3)
    # Without the instrumentation the thread would have spent its time on the work alone.
    assert report["roles"]["main"]["thread_seconds"] == pytest.approx(true_s, abs=2 * TICK)
    assert tiny["share"] == pytest.approx(1.0, abs=1e-3)


def test_nested_operations_are_refused():
    profiler = Profiler()
    with pytest.raises(RuntimeError, match="nest"):
        with profiler.measure("outer"):
            with profiler.measure("inner"):
                pass
    with profiler.measure("after"):  # the failed nesting leaves the thread usable
        pass


def _space(text):
    from jax.profiler import ProfileData

    return ProfileData.from_text_proto(text)


def test_device_busy_is_the_union_of_op_intervals_over_the_window():
    # Device 0: XLA ops at [1, 3) and [2, 4) us overlap: 3 us busy; its module
    # line spans idle gaps and is ignored. Device 1: only raw stream lines,
    # [0, 1) and [5, 6) us on two streams: 2 us busy. Window: 10 us.
    space = _space("""
    planes { id: 1 name: "/device:GPU:0"
      lines { id: 1 name: "XLA Ops" timestamp_ns: 1000
        events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 }
        events { metadata_id: 1 offset_ps: 1000000 duration_ps: 2000000 } }
      lines { id: 2 name: "XLA Modules" timestamp_ns: 0
        events { metadata_id: 2 offset_ps: 0 duration_ps: 9000000 } }
      event_metadata { key: 1 value { id: 1 name: "fusion" } }
      event_metadata { key: 2 value { id: 2 name: "jit_step" } } }
    planes { id: 2 name: "/device:GPU:1"
      lines { id: 1 name: "Stream #1(Compute)" timestamp_ns: 0
        events { metadata_id: 1 offset_ps: 0 duration_ps: 1000000 } }
      lines { id: 2 name: "Stream #2(MemcpyH2D)" timestamp_ns: 5000
        events { metadata_id: 1 offset_ps: 0 duration_ps: 1000000 } }
      event_metadata { key: 1 value { id: 1 name: "kernel" } } }
    planes { id: 3 name: "/host:CPU" }
    """)
    busy, reason = device_planes_busy(space, window_s=10e-6)
    assert reason is None
    assert busy == pytest.approx((0.3 + 0.2) / 2)


def test_no_device_plane_gives_no_number_and_says_why():
    busy, reason = device_planes_busy(_space('planes { id: 1 name: "/host:CPU" }'), window_s=1.0)
    assert busy is None and "no device plane" in reason


@pytest.fixture(scope="module")
def sebulba_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("profiled") / "sebulba"
    result = subprocess.run(
        [PYTHON, LAUNCHER, "--arch=sebulba", "--total-steps=20000", "--num-envs=16", "--log-every=2",
         f"--run-dir={run_dir}", "--profile", "--profile-trace-s=2"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return run_dir, result.stdout


def test_sebulba_profile_table_trace_and_events(sebulba_run):
    run_dir, stdout = sebulba_run
    summary = json.loads((run_dir / "summary.json").read_text())
    report = summary["profile"]
    actors, learner = _rows(report, "sebulba-actor"), _rows(report, "sebulba-learner")
    for name in ("env_step", "obs_to_device", "inference", "actions_to_host", "prepare", "actor_to_learner",
                 "actor_queue_wait", "actor_params_wait"):
        assert actors[name]["calls"] > 0, name
    for name in ("learner_queue_wait", "learner_update", "params_to_actors", "logging"):
        assert learner[name]["calls"] > 0, name
    assert learner["learner_update"]["calls"] == summary["updates"]
    for rows in (actors, learner):
        assert sum(row["share"] for row in rows.values()) == pytest.approx(1.0)
        for row in rows.values():
            if row["calls"]:
                assert row["mean_s"] == pytest.approx(row["seconds"] / row["calls"])
    # Most of each thread's time is in named operations (a mislaid thread or role would halve it).
    assert report["roles"]["sebulba-learner"]["measured_share"] > 0.5
    assert report["roles"]["sebulba-actor"]["measured_share"] > 0.5
    assert report["overhead_correction_s"] > 0 and 0 <= report["overhead_share"] < 0.05
    # The CPU backend has no device plane: no number, a reason.
    assert report["device_busy_share"] is None and report["device_busy_note"]
    assert "where the time went" in stdout and "sebulba-learner" in stdout

    # The trace, where TensorBoard's profile plugin looks for it, with the same names.
    traces = glob.glob(str(run_dir / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert traces == [report["trace_file"]]
    from jax.profiler import ProfileData

    space = ProfileData.from_file(traces[0])
    names = {event.name for plane in space.planes if plane.name.startswith("/host:")
             for line in plane.lines for event in line.events}
    assert {"env_step", "inference", "learner_update"} <= names

    # The scalars reach TensorBoard's event files, read back by TensorBoard's own reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sps = events.Scalars("podracer/sps")
    assert [e.step for e in sps] == [r["env_steps"] for r in rows]
    assert [e.value for e in sps] == pytest.approx([r["sps"] for r in rows], rel=1e-6)
    assert "podracer/time_learner_update_s" in events.Tags()["scalars"]


def test_xprof_reads_the_trace(sebulba_run):
    """TensorBoard's profile plugin (xprof) turns the trace into its trace viewer's events."""
    from xprof.convert import raw_to_tool_data

    run_dir, _ = sebulba_run
    trace = json.loads((run_dir / "summary.json").read_text())["profile"]["trace_file"]
    data, _ = raw_to_tool_data.xspace_to_tool_data([trace], "trace_viewer", {})
    names = {event.get("name") for event in json.loads(data)["traceEvents"]}
    assert {"env_step", "learner_update"} <= names


def test_plot_of_a_profiled_run_is_a_png(sebulba_run, tmp_path):
    run_dir, _ = sebulba_run
    out = tmp_path / "profiled.png"
    result = subprocess.run([PYTHON, "-m", "podracer.plot", str(run_dir), "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[1] >= 1500  # three panels: the breakdown is drawn
    assert image.std() > 0.05  # not blank


def _configs(tmp_path, name, *flags):
    from podracer.orchestrate.cli import parse_configs

    return parse_configs([f"--run-dir={tmp_path / name}", "--checkpoint-every=0", *flags])


def test_anakin_profile_mode_times_the_phases_of_the_same_computation(tmp_path):
    from podracer.anakin.train import train_ppo

    flags = ("--total-steps=2048", "--num-envs=16", "--rollout-len=32", "--updates-per-call=2",
             "--epochs=1", "--minibatches=2")
    devices = jax.devices()[:1]
    fused, _ = train_ppo(_configs(tmp_path, "fused", *flags), devices)
    profiled, _ = train_ppo(_configs(tmp_path, "profiled", *flags, "--profile",
                                     "--profile-trace-s=0"), devices)
    # Split into two programs, the run computes the same parameters and returns.
    assert profiled["params_fingerprints"] == fused["params_fingerprints"]
    assert profiled["episode_return_mean"] == pytest.approx(fused["episode_return_mean"])
    report = profiled["profile"]
    main = _rows(report, "main")
    assert main["acting"]["calls"] == main["learning"]["calls"] == profiled["updates"] == 4
    assert main["logging"]["calls"] == 2 and main["checkpoint"]["calls"] == 1
    assert "not the production figure" in report["note"]
    assert report["trace_file"] is None and report["device_busy_share"] is None
    assert "profile" not in fused


def _es_fused_and_profiled(tmp_path, flags):
    """The same Anakin ES run fused and in profile mode on 2 devices: their summaries, the
    mean parameters checked equal."""
    from podracer.anakin.train_es import train_es

    devices = jax.devices()[:2]
    fused, fused_runner = train_es(_configs(tmp_path, "fused", *flags), devices)
    profiled, profiled_runner = train_es(_configs(tmp_path, "profiled", *flags, "--profile",
                                                  "--profile-trace-s=0"), devices)
    np.testing.assert_allclose(np.asarray(profiled_runner.train.strategy.mean),
                               np.asarray(fused_runner.train.strategy.mean), rtol=1e-6, atol=1e-6)
    return fused, profiled


def test_anakin_es_profile_mode_times_evaluate_and_tell(tmp_path):
    fused, profiled = _es_fused_and_profiled(tmp_path, (
        "--algo=es", "--population=16", "--horizon=50", "--generations-per-call=3",
        "--total-steps=4800", "--eval-episodes=2"))
    assert profiled["mean_params_return"] == pytest.approx(fused["mean_params_return"])
    main = _rows(profiled["profile"], "main")
    assert main["evaluate"]["calls"] == main["tell"]["calls"] == profiled["generations"] == 6
    assert main["evaluate_mean"]["calls"] == 2


def test_anakin_es_population_profile_mode_times_evaluate_and_tell_of_every_agent(tmp_path):
    # Every agent's mean, and every agent's logged figures, as the fused population step's.
    fused, profiled = _es_fused_and_profiled(tmp_path, (
        "--algo=es", "--population=8", "--horizon=30", "--generations-per-call=2",
        "--total-steps=960", "--eval-episodes=2", "--hidden", "8", "--num-seeds=2",
        "--sweep", "sigma=0.05,0.1"))
    assert [a["mean_params_return"] for a in profiled["agents"]] == pytest.approx(
        [a["mean_params_return"] for a in fused["agents"]])
    rows = {name: [json.loads(line)["agents"] for line in (tmp_path / name / "metrics.jsonl").open()]
            for name in ("fused", "profiled")}
    keys = ("episode_return_mean", "episode_return_max", "episode_return_min")
    fitness = {name: [[agent[k] for agent in row for k in keys] for row in agents]
               for name, agents in rows.items()}
    np.testing.assert_allclose(fitness["profiled"], fitness["fused"], rtol=1e-5)
    main = _rows(profiled["profile"], "main")
    assert main["evaluate"]["calls"] == main["tell"]["calls"] == profiled["generations"] == 4
    assert main["evaluate_mean"]["calls"] == 2 and "population_step" not in main


def test_sebulba_es_profile_attributes_actor_and_learner_time(tmp_path):
    from podracer.sebulba.train_es import train_es

    configs = _configs(tmp_path, "sebulba-es", "--arch=sebulba", "--algo=es", "--population=16",
                       "--total-steps=20000", "--profile", "--profile-trace-s=0")
    summary, _ = train_es(configs, jax.devices()[:2])
    report = summary["profile"]
    actors, learner = _rows(report, "sebulba-es-actor"), _rows(report, "sebulba-es-learner")
    for name in ("env_step", "inference", "for_rollout", "actor_params_wait", "actor_queue_wait"):
        assert actors[name]["calls"] > 0, name
    assert learner["learner_update"]["calls"] == learner["logging"]["calls"] == summary["generations"]
    assert report["roles"]["sebulba-es-learner"]["measured_share"] > 0.5
