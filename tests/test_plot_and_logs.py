import json
import subprocess

import pytest

from conftest import LAUNCHER, PYTHON


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeds")
    dirs = []
    for seed in (0, 1):
        run_dir = root / f"seed{seed}"
        result = subprocess.run([PYTHON, LAUNCHER, "--total-steps=60000", f"--seed={seed}",
                                 f"--run-dir={run_dir}", "--checkpoint-every=0"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        dirs.append(run_dir)
    return dirs


def test_tensorboard_events_read_back(two_seeds):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = two_seeds[0]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    returns = events.Scalars("podracer/episode_return_mean")
    assert [e.step for e in returns] == [r["env_steps"] for r in rows]
    assert [e.value for e in returns] == pytest.approx([r["episode_return_mean"] for r in rows], rel=1e-6)
    assert "podracer/loss" in events.Tags()["scalars"]


def test_plot_writes_a_png_of_the_runs(two_seeds, tmp_path):
    out = tmp_path / "curves.png"
    result = subprocess.run([PYTHON, "-m", "podracer.plot", *map(str, two_seeds), "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from PIL import Image

    image = Image.open(out)
    image.verify()
    assert image.size[0] >= 1000  # two panels side by side
    # The two seeds are one group (one curve with a band), not two.
    from podracer.plot import group_by_seed

    groups = group_by_seed([str(d) for d in two_seeds])
    assert len(groups) == 1 and len(groups[0][1]) == 2


def test_plot_of_a_directory_without_runs(tmp_path):
    result = subprocess.run([PYTHON, "-m", "podracer.plot", str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1


def test_a_run_plotted_through_a_link_is_named_for_the_run(two_seeds, tmp_path):
    from podracer.plot import group_by_seed

    latest = tmp_path / "latest"
    latest.symlink_to(two_seeds[0], target_is_directory=True)
    [(label, dirs)] = group_by_seed([str(latest)])
    assert label.endswith(": seed0") and dirs == [str(latest)]
