"""The worker startup script: run under bash with recording stand-ins for
python3 and curl, so the tests see exactly what a worker would execute."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from podracer.errors import PodracerError
from podracer.provision.spec import WorkerLayout
from podracer.provision.startup import WorkerState, make_startup_script, parse_worker_state

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

HOSTILE_FLAGS = [
    "--arch=sebulba",
    "--note=; rm -rf / ;",
    "--name=$(touch PWNED_SUBSHELL)",
    "--tag=`touch PWNED_BACKTICK`",
    "--quote=it's \"quoted\"",
    "--multi=line one\nline two; touch PWNED_NEWLINE",
    "--var=$HOME ${PATH} $((1+1))",
    "--glob=*",
    "&& touch PWNED_AND",
    "--empty=",
    "",
]
LAUNCHER = textwrap.dedent("""\
    import sys
    # $(touch PWNED_LAUNCHER) `touch PWNED_LAUNCHER` ${HOME}
    print(sys.argv)
""")

# Stands in for python3 (and, through it, uv and the venv's python) and for curl:
# records its argv, creates the venv's python when asked to, fails on request.
RECORDER = """#!{python}
import json, os, shutil, sys
log = os.environ["RECORD_DIR"]
name = os.path.basename(sys.argv[0])
with open(os.path.join(log, "calls.jsonl"), "a") as out:
    out.write(json.dumps({{"program": name, "argv": sys.argv[1:], "cwd": os.getcwd()}}) + "\\n")
args = sys.argv[1:]
print("stand-in", name, "ran")
if args[:3] == ["-m", "uv", "venv"]:
    bin_dir = os.path.join(args[-1], "bin")
    os.makedirs(bin_dir, exist_ok=True)
    shutil.copy(sys.argv[0], os.path.join(bin_dir, "python"))
if args[:4] == ["-m", "uv", "pip", "install"] and os.environ.get("FAIL_INSTALL"):
    sys.exit(7)
if os.path.basename(os.path.dirname(os.path.dirname(sys.argv[0]))) == "venv":
    sys.exit(int(os.environ.get("TRAINING_EXIT", "0")))
"""


def _run_script(tmp_path: Path, script: str, **env: str) -> list[dict]:
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    records = tmp_path / "records"
    records.mkdir(exist_ok=True)
    for program in ("python3", "curl"):
        path = stubs / program
        path.write_text(RECORDER.format(python=sys.executable))
        path.chmod(0o755)
    script_path = tmp_path / "startup.sh"
    script_path.write_text(script)
    subprocess.run(
        [BASH, str(script_path)], cwd=tmp_path, timeout=60, check=False,
        env={"PATH": f"{stubs}:/usr/bin:/bin", "RECORD_DIR": str(records),
             "HOME": str(tmp_path), **env},
    )
    lines = (records / "calls.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _published_states(calls: list[dict]) -> list[str]:
    return [call["argv"][call["argv"].index("--data") + 1]
            for call in calls if call["program"] == "curl"]


@pytest.fixture
def layout(tmp_path) -> WorkerLayout:
    # A home with a space and a quote in it: the paths must be quoted too.
    return WorkerLayout(home=str(tmp_path / "po dracer's home"))


def test_hostile_flags_reach_the_launcher_verbatim_and_nothing_escapes(tmp_path, layout):
    hostile_spec = "podracer==0.1.0; touch PWNED_SPEC $(touch PWNED_SPEC2)"
    script = make_startup_script(hostile_spec, LAUNCHER, HOSTILE_FLAGS, layout)

    calls = _run_script(tmp_path, script)

    training = [call for call in calls if call["program"] == "python"]
    assert len(training) == 1
    assert training[0]["argv"] == ["launch/tpu.py", *HOSTILE_FLAGS, "--distributed=auto"]
    assert training[0]["cwd"] == layout.run_dir
    install = [call["argv"] for call in calls if call["argv"][:4] == ["-m", "uv", "pip", "install"]]
    assert install == [["-m", "uv", "pip", "install", "--python", f"{layout.venv}/bin/python",
                        "jax[tpu]", hostile_spec]]
    assert (Path(layout.run_dir) / "launch" / "tpu.py").read_text() == LAUNCHER
    pwned = [path for path in tmp_path.rglob("PWNED*")] + list(Path("/").glob("PWNED*"))
    assert pwned == []
    assert _published_states(calls) == ["installing", "running", "exit=0"]


def test_training_exit_code_is_published_and_a_reboot_does_not_rerun(tmp_path, layout):
    script = make_startup_script("podracer", LAUNCHER, ["--arch=anakin"], layout)

    first = _run_script(tmp_path, script, TRAINING_EXIT="3")
    assert _published_states(first) == ["installing", "running", "exit=3"]
    assert Path(layout.exit_code_path).read_text().strip() == "3"

    everything = _run_script(tmp_path, script)  # the calls file accumulates
    second = everything[len(first):]
    assert [call["program"] for call in second] == ["curl"]
    assert _published_states(second) == ["exit=3"]


def test_failed_install_is_published_and_training_never_starts(tmp_path, layout):
    script = make_startup_script("podracer", LAUNCHER, ["--arch=anakin"], layout)

    calls = _run_script(tmp_path, script, FAIL_INSTALL="1")

    assert [call for call in calls if call["program"] == "python"] == []
    assert _published_states(calls) == ["installing", "install-failed=7"]


def test_install_and_training_output_go_to_the_training_log(tmp_path, layout):
    script = make_startup_script("podracer", LAUNCHER, [], layout)

    _run_script(tmp_path, script)

    log = Path(layout.log_path).read_text().splitlines()
    assert "stand-in python3 ran" in log
    assert "stand-in python ran" in log


def test_script_is_valid_bash_for_an_empty_flag_list():
    script = make_startup_script("podracer", LAUNCHER, [])
    done = subprocess.run([BASH, "-n"], input=script, text=True, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert script.startswith("#!/bin/bash\n")


def test_a_launcher_that_would_end_the_heredoc_is_refused():
    launcher = "print(1)\nPODRACER_LAUNCHER_EOF\nprint(2)\n"
    with pytest.raises(PodracerError, match="PODRACER_LAUNCHER_EOF"):
        make_startup_script("podracer", launcher, [])


@pytest.mark.parametrize("value, expected", [
    (None, WorkerState("booting")),
    ("installing", WorkerState("installing")),
    ("running", WorkerState("running")),
    ("exit=0", WorkerState("exited", 0)),
    ("exit=137", WorkerState("exited", 137)),
    ("install-failed=1", WorkerState("install-failed", 1)),
    ("exit=garbage", WorkerState("unknown (exit=garbage)")),
])
def test_parse_worker_state(value, expected):
    assert parse_worker_state(value) == expected


def test_worker_state_outcomes():
    assert WorkerState("exited", 0).finished and not WorkerState("exited", 0).failed
    assert WorkerState("exited", 2).failed
    assert WorkerState("install-failed", 1).failed
    assert not WorkerState("running").finished
    assert WorkerState("install-failed", 1).describe() == "install failed (exit 1)"
