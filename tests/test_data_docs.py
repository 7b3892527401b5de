"""The datasets page's snippet runs as written."""

import re

from conftest import REPO_ROOT


def test_datasets_snippet_runs(tmp_path, monkeypatch, capsys):
    text = open(f"{REPO_ROOT}/docs/datasets.md").read()
    snippet = re.search(r"<!-- snippet: datasets -->\s*```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)  # the snippet writes ./cartpole-demo
    namespace: dict = {}
    exec(compile(snippet, "docs/datasets.md", "exec"), namespace)
    assert int(namespace["state"].step) == 10
    assert namespace["batch"].steps["observation"].shape[0] == 4
    assert (tmp_path / "cartpole-demo" / "dataset_info.json").is_file()
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and float(lines[1]) < 0  # a log-likelihood
