"""What a slice's workers install and where its run lives: the wheel of the working
tree (version stamped), the lock of its dependencies, and the run directory in a bucket."""

import importlib.metadata as metadata
import shutil
import subprocess
import zipfile

import pytest

from podracer.errors import PodracerError
from podracer.provision import staging

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c",
                           "user.email=t@example.com", *args],
                          check=True, capture_output=True, text=True, timeout=30).stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    """A small project laid out as podracer's (pyproject.toml, podracer/version.py), committed."""
    root = tmp_path / "checkout"
    (root / "podracer").mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "podracer-rl"\nversion = "0.1.0"\ndependencies = ["six>=1"]\n\n'
        '[project.optional-dependencies]\ngcs = ["packaging"]\nall = ["podracer-rl[gcs]"]\n\n'
        '[tool.setuptools.packages.find]\ninclude = ["podracer*"]\n')
    (root / "podracer" / "__init__.py").write_text("from podracer.version import __version__\n")
    (root / "podracer" / "version.py").write_text('__version__ = "0.1.0"\n')
    (root / ".gitignore").write_text("ignored.py\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "first")
    return root


def test_the_version_names_the_commit_and_whether_the_tree_is_dirty(checkout):
    commit = _git(checkout, "rev-parse", "HEAD")
    assert staging.stamped_version(checkout) == f"0.1.0+g{commit[:12]}"
    (checkout / "podracer" / "new.py").write_text("x = 1\n")  # untracked, not ignored
    assert staging.stamped_version(checkout) == f"0.1.0+g{commit[:12]}.dirty"


def test_the_wheel_is_the_working_tree_as_it_is_now(checkout, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (checkout / "podracer" / "__init__.py").write_text("CHANGED = True\n")  # not committed
    (checkout / "podracer" / "untracked.py").write_text("y = 2\n")
    (checkout / "podracer" / "ignored.py").write_text("z = 3\n")

    wheel = staging.build_wheel(tmp_path / "out", root=checkout)

    version = staging.stamped_version(checkout)
    assert version.endswith(".dirty") and wheel.name == f"podracer_rl-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert archive.read("podracer/__init__.py") == b"CHANGED = True\n"
        assert archive.read("podracer/version.py").decode() == f'__version__ = "{version}"\n'
        assert "podracer/untracked.py" in names and "podracer/ignored.py" not in names
    # The checkout itself is untouched: its own version line, no build folders.
    assert (checkout / "podracer" / "version.py").read_text() == '__version__ = "0.1.0"\n'
    assert not (checkout / "build").exists()

    # The same tree again is taken from the cache; a changed tree is built anew.
    cached = list((tmp_path / "cache" / "podracer" / "wheels").glob("*/*.whl"))
    assert len(cached) == 1
    staging.build_wheel(tmp_path / "out2", root=checkout)
    assert len(list((tmp_path / "cache" / "podracer" / "wheels").glob("*/*.whl"))) == 1
    (checkout / "podracer" / "untracked.py").write_text("y = 3\n")
    changed = staging.build_wheel(tmp_path / "out3", root=checkout)
    with zipfile.ZipFile(changed) as archive:
        assert archive.read("podracer/untracked.py") == b"y = 3\n"


def test_a_tree_that_is_not_a_git_checkout_is_refused_in_one_line(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "1"\n')
    with pytest.raises(PodracerError, match="not a git checkout"):
        staging.build_wheel(tmp_path / "out", root=tmp_path)


def test_the_lock_pins_every_dependency_as_installed_here_and_jax_for_tpu():
    lines = staging.lock(("gcs",))
    pins = dict(line.split("==") for line in lines)
    jax_version = metadata.version("jax")
    assert pins["jax[tpu]"] == jax_version and "jax" not in pins
    # Direct and transitive dependencies alike, each at its installed version.
    for name in ("flax", "optax", "orbax-checkpoint", "gcsfs", "jaxlib", "numpy", "tensorstore"):
        assert pins[name] == metadata.version(name), name
    assert "podracer-rl" not in pins  # the wheel itself is staged beside the lock
    names = [line.split("==")[0].split("[")[0] for line in lines]
    assert all(line.count("==") == 1 for line in lines) and names == sorted(names)
    # An extra the workers do not need stays out.
    assert "google-cloud-tpu" not in pins and "pytest" not in pins


def test_a_dependency_that_is_not_installed_cannot_be_locked(checkout):
    (checkout / "pyproject.toml").write_text(
        (checkout / "pyproject.toml").read_text().replace('"six>=1"', '"six>=1", "no-such-dist-xyz"'))
    with pytest.raises(PodracerError, match="no-such-dist-xyz is not installed here"):
        staging.lock(("gcs",), root=checkout)


def test_self_referencing_extras_are_followed(checkout):
    assert dict(line.split("==") for line in staging.lock(("all",), root=checkout)).keys() == {
        "six", "packaging"}


@pytest.mark.parametrize("bucket, flags, expected", [
    (None, ["--run-dir=gs://b1/my/run"], "gs://b1/my/run"),
    ("gs://b1", ["--run-dir", "gs://b1/x/"], "gs://b1/x"),
])
def test_a_run_dir_in_a_bucket_is_used_as_given(bucket, flags, expected):
    assert staging.slice_run_dir(bucket, flags, "s1") == expected


def test_a_bucket_alone_gives_each_run_its_own_directory():
    when = 1_800_000_000.0
    run_dir = staging.slice_run_dir("gs://b1/team/", ["--arch=sebulba", "--env=Pong-v5"], "s1", when)
    assert run_dir.startswith("gs://b1/team/runs/s1-sebulba-ppo-Pong-v5-")
    assert run_dir != staging.slice_run_dir("gs://b1/team/", ["--arch=sebulba"], "s1", when + 1)


@pytest.mark.parametrize("bucket, flags, fragment", [
    (None, [], "need a bucket"),
    (None, ["--run-dir=runs/x"], "deleted with the slice"),
    ("gs://b1", ["--run-dir=gs://b2/x"], "is not in --bucket"),
    ("b1", [], "is not gs://BUCKET"),
    ("gs://", [], "is not gs://BUCKET"),
])
def test_a_run_whose_results_would_be_lost_is_refused(bucket, flags, fragment):
    with pytest.raises(PodracerError, match=fragment):
        staging.slice_run_dir(bucket, flags, "s1")
