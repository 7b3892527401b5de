import re

from conftest import REPO_ROOT


def _snippet(name: str) -> str:
    text = open(f"{REPO_ROOT}/README.md").read()
    match = re.search(rf"<!-- snippet: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"README has no snippet {name!r}"
    return match.group(1)


def test_own_loop_snippet_runs_and_updates(capsys):
    namespace: dict = {}
    exec(compile(_snippet("own-loop"), "README.md", "exec"), namespace)
    state = namespace["state"]
    assert int(state.step) == 3
    printed = capsys.readouterr().out.split("\n")
    assert [line.split()[0] for line in printed if line] == ["0", "1", "2"]
