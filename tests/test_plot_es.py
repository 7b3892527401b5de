"""An evolution strategies run's headline curve is the return of its mean parameters."""

import json

import numpy as np
import pytest

from podracer import plot

STEPS = [1000, 2000, 3000, 4000]
MEAN_PARAMS = [20.0, 150.0, 400.0, 500.0]
POPULATION = [15.0, 60.0, 120.0, 180.0]


def _run(run_dir, algo: str, returns: list[float], mean_params: list[float] | None = None):
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i, steps in enumerate(STEPS):
            row = {"env_steps": steps, "sps": 1000.0, "wall_s": 1.5 * (i + 1),
                   "episode_return_mean": returns[i]}
            if mean_params is not None:
                row["mean_params_return"] = mean_params[i]
            f.write(json.dumps(row) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"arch": "anakin", "algo": algo, "env": "CartPole-v1"}))
    return str(run_dir)


@pytest.fixture
def es_run(tmp_path):
    return _run(tmp_path / "es", "es", POPULATION, MEAN_PARAMS)


@pytest.fixture
def ppo_run(tmp_path):
    return _run(tmp_path / "ppo", "ppo", [10.0, 30.0, 90.0, 200.0])


def _line(ax, label_part: str):
    (line,) = [line for line in ax.get_lines() if label_part in line.get_label()]
    return line


def test_es_plan_heads_with_the_mean_parameters(es_run):
    y_label, (group,) = plot.plan([es_run])
    assert group.headline.y_key == "mean_params_return"
    assert group.headline.label.endswith("return of the mean parameters")
    assert group.companion.y_key == "episode_return_mean"
    assert group.companion.label.endswith("population mean fitness")
    assert y_label == "episode return"


def test_ppo_plan_is_unchanged(ppo_run):
    y_label, (group,) = plot.plan([ppo_run])
    assert y_label == "mean episode return"
    assert group.headline == plot.Curve("episode_return_mean", "anakin ppo CartPole-v1: ppo")
    assert group.companion is None
    curve = plot.read_curve(ppo_run)
    assert set(curve) == {"env_steps", "wall_s", "episode_return_mean"}
    np.testing.assert_array_equal(curve["episode_return_mean"], [10.0, 30.0, 90.0, 200.0])


def test_es_figure_draws_the_mean_parameters_solid(es_run):
    fig = plot.figure([es_run])
    for ax, x_key in zip(fig.axes[:2], ("env_steps", "wall_s")):
        xs = [1.5 * (i + 1) for i in range(len(STEPS))] if x_key == "wall_s" else STEPS
        headline = _line(ax, "return of the mean parameters")
        np.testing.assert_allclose(headline.get_ydata(), np.interp(headline.get_xdata(), xs, MEAN_PARAMS))
        assert headline.get_linestyle() == "-"
        population = _line(ax, "population mean fitness")
        np.testing.assert_allclose(population.get_ydata(), np.interp(population.get_xdata(), xs, POPULATION))
        assert population.get_linestyle() == "--"
        assert population.get_linewidth() < headline.get_linewidth()
        assert ax.get_ylabel() == "episode return"
    legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert legend == ["anakin es CartPole-v1: es: return of the mean parameters",
                      "anakin es CartPole-v1: es: population mean fitness"]


def test_mixed_runs_say_what_each_curve_is(es_run, ppo_run):
    fig = plot.figure([ppo_run, es_run])
    ax = fig.axes[0]
    assert ax.get_ylabel() == "episode return"
    ppo = _line(ax, "ppo CartPole-v1: ppo: mean episode return")
    np.testing.assert_allclose(ppo.get_ydata(), np.interp(ppo.get_xdata(), STEPS, [10.0, 30.0, 90.0, 200.0]))
    es = _line(ax, "es CartPole-v1: es: return of the mean parameters")
    np.testing.assert_allclose(es.get_ydata(), np.interp(es.get_xdata(), STEPS, MEAN_PARAMS))
    assert len(ax.get_lines()) == 3


def test_plot_writes_a_png_of_an_es_run(es_run, ppo_run, tmp_path):
    out = tmp_path / "es.png"
    assert plot.plot([es_run, ppo_run], str(out)) == str(out)
    from PIL import Image

    with Image.open(out) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] >= 1000  # two panels side by side
