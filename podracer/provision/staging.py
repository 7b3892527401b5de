"""The exact code a slice runs, and where its run lives: both in the run's bucket.

A slice's workers install nothing by name from an index that this machine did
not resolve first:

- a wheel of this working tree, as it is now (uncommitted and untracked files
  included), its version stamped with the git commit and a `.dirty` marker
  (`0.1.0+g1a2b3c4d5e6f.dirty`), so `podracer.__version__` on a worker says
  which code ran;
- a lock: every distribution that wheel needs, at the version installed here
  (`name==version`), with `jax[tpu]` at the local `jax` version; the workers'
  `uv` is pinned too (`UV_VERSION`);
- the launcher file the workers run, and beside it a `py:MODULE:FUNCTION`
  environment's module from the working directory (`podracer.provision.needs`,
  which also names the extras the run's flags need in the lock).

They go to `RUN_DIR/code/`. The run directory is always in a bucket (the
slice's disks are deleted with it): `--run-dir=gs://BUCKET/PATH`, or
`--bucket=gs://BUCKET[/PREFIX]`, under which each run gets
`runs/ARCH-ALGO-ENV-YYYYmmdd-HHMMSS`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Sequence

from packaging.requirements import Requirement

from podracer.errors import PodracerError
from podracer import storage

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LAUNCHER = REPO_ROOT / "launch" / "tpu.py"
# The distribution's name (the import package is `podracer`; that name on PyPI is
# another project's, so nothing here ever asks an index for it).
DISTRIBUTION = "podracer-rl"
# What the workers install podracer with; `uv venv --clear` (a rebooted worker
# makes its venv again) needs 0.8 or later. Tests install this very version.
UV_VERSION = "0.13.9"
# The extras every worker needs: the run directory is in a bucket.
WORKER_EXTRAS = ("gcs",)
CODE_FOLDER = "code"
LOCK_NAME = "requirements.lock"
LAUNCHER_NAME = "launcher.py"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# -- where the run lives ------------------------------------------------------


def _flag_value(flags: Sequence[str], name: str) -> str | None:
    """The last value of `--name=V` or `--name V` in `flags`, or None."""
    value = None
    for index, arg in enumerate(flags):
        if arg == name and index + 1 < len(flags):
            value = flags[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _bucket_of(url: str) -> str:
    return url[len(storage.REMOTE_SCHEME):].split("/", 1)[0]


def slice_run_dir(bucket: str | None, training_flags: Sequence[str], slice_name: str,
                  when: float | None = None) -> str:
    """The run directory of a run on a slice: always `gs://...`.

    `--run-dir=gs://B/P` among the training flags is used as it is (`--bucket`,
    if given too, must name the same bucket); otherwise the run gets
    `BUCKET[/PREFIX]/runs/SLICE-ARCH-ALGO-ENV-YYYYmmdd-HHMMSS`.
    """
    run_dir = _flag_value(training_flags, "--run-dir")
    if bucket is not None:
        if not bucket.startswith(storage.REMOTE_SCHEME) or not _bucket_of(bucket):
            raise PodracerError(f"--bucket={bucket} is not gs://BUCKET[/PREFIX]; pass a "
                                "Cloud Storage bucket, e.g. --bucket=gs://my-bucket")
    if run_dir is not None:
        if not run_dir.startswith(storage.REMOTE_SCHEME) or not _bucket_of(run_dir):
            raise PodracerError(
                f"--run-dir={run_dir} would be on the workers' disks, which are deleted with the "
                "slice; pass --run-dir=gs://BUCKET/PATH, or --bucket=gs://BUCKET alone")
        if bucket is not None and _bucket_of(bucket) != _bucket_of(run_dir):
            raise PodracerError(f"--run-dir={run_dir} is not in --bucket={bucket}; pass one of them")
        return run_dir.rstrip("/")
    if bucket is None:
        raise PodracerError(
            "a slice's results need a bucket (its disks are deleted with it): pass "
            "--bucket=gs://BUCKET (or --run-dir=gs://BUCKET/PATH); see docs/tpu.md")
    from podracer.orchestrate.parse import parse

    run = parse(list(training_flags)).configs.run
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if when is None else when))
    env = re.sub(r"[^A-Za-z0-9._-]+", "_", run.env)
    return storage.join(bucket.rstrip("/"), "runs",
                        f"{slice_name}-{run.arch}-{run.algo}-{env}-{stamp}")


def code_dir(run_dir: str) -> str:
    return storage.join(run_dir, CODE_FOLDER)


# -- the wheel -----------------------------------------------------------------


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _base_version(root: Path) -> str:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]


def source_files(root: Path) -> list[str]:
    """The working tree's files as a user sees them: tracked and untracked, not ignored."""
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if listed is None:
        raise PodracerError(f"{root} is not a git checkout; the workers install a wheel of a "
                            "checkout: run from one (git clone, or git init and add your files)")
    return sorted(name for name in listed.split("\0") if name and (root / name).is_file())


def stamped_version(root: Path) -> str:
    """`0.1.0+g<commit>` (and `.dirty` with changes not committed): which code this is."""
    base = _base_version(root)
    commit = (_git(root, "rev-parse", "HEAD") or "").strip()
    local = f"g{commit[:12]}" if commit else "guncommitted"
    if _git(root, "status", "--porcelain", "--untracked-files=normal"):
        local += ".dirty"
    return f"{base}+{local}"


def wheel_cache() -> Path:
    """Built wheels, one folder per working-tree content: a relaunch of the same tree builds nothing."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "podracer" / "wheels"


def _tree_digest(root: Path, names: list[str], version: str) -> str:
    digest = hashlib.sha256(version.encode())
    for name in names:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def build_wheel(out_dir: Path, root: Path = REPO_ROOT) -> Path:
    """A wheel of the working tree at `root` with its version stamped, in `out_dir`; returns its path.

    Built by pip (PEP 517, setuptools as pyproject.toml asks) from a copy of the
    tree's files, so neither the checkout nor its build folders are touched;
    kept in `wheel_cache()` under a digest of the tree's files, and taken from
    there when the tree is the same.
    """
    version = stamped_version(root)
    names = source_files(root)
    cached = wheel_cache() / _tree_digest(root, names, version)
    found = sorted(cached.glob("*.whl"))
    if not found:
        _build_into(cached, root, names, version)
        found = sorted(cached.glob("*.whl"))
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / found[0].name
    shutil.copy2(found[0], target)
    return target


def _build_into(cached: Path, root: Path, names: list[str], version: str) -> None:
    with tempfile.TemporaryDirectory(prefix="podracer-wheel-") as tmp:
        tree = Path(tmp) / "src"
        for name in names:
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, tree / name)
        _stamp(tree / "pyproject.toml", r'^version\s*=\s*"[^"]*"', f'version = "{version}"')
        _stamp(tree / "podracer" / "version.py", r'^__version__\s*=\s*"[^"]*"',
               f'__version__ = "{version}"')
        built = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir",
             str(tmp), str(tree)], capture_output=True, text=True, check=False)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if built.returncode != 0 or len(wheels) != 1:
            last = (built.stderr.strip().splitlines() or ["no wheel was written"])[-1]
            raise PodracerError(f"building the wheel the workers install failed ({last}); "
                                f"check that `pip wheel --no-deps {root}` works")
        # Written beside, then renamed: a concurrent launch never sees half a wheel.
        cached.mkdir(parents=True, exist_ok=True)
        partial = cached / (wheels[0].name + f".{os.getpid()}.part")
        shutil.move(str(wheels[0]), partial)
        os.replace(partial, cached / wheels[0].name)


def _stamp(path: Path, pattern: str, line: str) -> None:
    text, count = re.subn(pattern, line, path.read_text(), count=1, flags=re.MULTILINE)
    if count != 1:
        raise PodracerError(f"cannot stamp the version in {path.name}: no line matches {pattern}")
    path.write_text(text)


# -- the lock ------------------------------------------------------------------


def _top_requirements(root: Path, extras: Sequence[str]) -> list[Requirement]:
    """pyproject.toml's dependencies and those of `extras`, self-references expanded."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    found: list[Requirement] = []
    pending, seen = list(extras), set()
    requirements = [Requirement(line) for line in project.get("dependencies", [])]
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise PodracerError(f"pyproject.toml has no extra named {extra!r}")
        requirements += [Requirement(line) for line in optional[extra]]
    for requirement in requirements:
        if _normal(requirement.name) == DISTRIBUTION:
            pending_extras = [e for e in requirement.extras if e not in seen]
            if pending_extras:
                found += _top_requirements(root, pending_extras)
            continue
        found.append(requirement)
    return found


def _applies(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": extra}) for extra in ({""} | extras))


def lock(extras: Sequence[str] = WORKER_EXTRAS, root: Path = REPO_ROOT) -> list[str]:
    """`name==version` for every distribution the wheel needs, as installed here, sorted.

    Environment markers are evaluated for this interpreter (workers run the
    same Python minor version on Linux x86-64, as TPU VMs are). `jax` becomes
    `jax[tpu]` at the same version.
    """
    versions: dict[str, str] = {}
    wanted: dict[str, set[str]] = {}
    pending = [(requirement, set(requirement.extras))
               for requirement in _top_requirements(root, extras) if _applies(requirement, set())]
    while pending:
        requirement, with_extras = pending.pop()
        name = _normal(requirement.name)
        try:
            distribution = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            raise PodracerError(
                f"{requirement.name} is not installed here, so its version cannot be locked for "
                f"the workers; pip install -e \".[{','.join(extras)}]\" first") from None
        known = wanted.setdefault(name, set())
        if name in versions and with_extras <= known:
            continue
        versions[name] = distribution.version
        known |= with_extras
        for line in distribution.requires or []:
            sub = Requirement(line)
            if _applies(sub, known):
                pending.append((sub, set(sub.extras)))
    lines = []
    for name, version in sorted(versions.items()):
        lines.append(f"jax[tpu]=={version}" if name == "jax" else f"{name}=={version}")
    return lines


# -- staging -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Staged:
    """What the workers install, built here; `upload` puts it in `code_dir`."""

    wheel: Path
    lock_text: str
    launcher_text: str
    code_dir: str
    modules: tuple[tuple[str, Path], ...] = ()  # (name beside the launcher, its file): a py: env's

    @property
    def names(self) -> dict[str, str]:
        """Role -> file name in `code_dir`."""
        return {"wheel": self.wheel.name, "lock": LOCK_NAME, "launcher": LAUNCHER_NAME,
                **{f"module:{name}": name for name, _ in self.modules}}

    def describe(self) -> list[str]:
        """One line per staged file: its URL, size and sha256 prefix."""
        contents = {self.wheel.name: self.wheel.read_bytes(), LOCK_NAME: self.lock_text.encode(),
                    LAUNCHER_NAME: self.launcher_text.encode(),
                    **{name: path.read_bytes() for name, path in self.modules}}
        return [f"{storage.join(self.code_dir, name)}  {len(data):,} bytes  "
                f"sha256 {hashlib.sha256(data).hexdigest()[:16]}"
                for name, data in contents.items()]

    def upload(self) -> None:
        storage.upload(str(self.wheel), storage.join(self.code_dir, self.wheel.name))
        storage.write_text(storage.join(self.code_dir, LOCK_NAME), self.lock_text)
        storage.write_text(storage.join(self.code_dir, LAUNCHER_NAME), self.launcher_text)
        for name, path in self.modules:
            storage.upload(str(path), storage.join(self.code_dir, name))


def read_launcher(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as error:
        raise PodracerError(
            f"cannot read the launcher {path} ({error.strerror}); run from a podracer "
            "checkout or pass --launcher=PATH") from None


def prepare(run_dir: str, launcher: Path, build_dir: Path, extras: Sequence[str],
            modules: dict[str, Path] | None = None) -> Staged:
    """Builds the wheel and the lock for `run_dir`'s code folder (nothing is uploaded).

    `modules`: files staged beside the launcher, by name (a `py:` environment's
    module, `podracer.provision.needs.env_module_files`).
    """
    lock_lines = lock(extras)
    header = (f"# what the workers of {run_dir} install, resolved on the machine that launched "
              f"it (Python {sys.version_info.major}.{sys.version_info.minor}); uv=={UV_VERSION}\n")
    return Staged(wheel=build_wheel(build_dir), lock_text=header + "\n".join(lock_lines) + "\n",
                  launcher_text=read_launcher(launcher), code_dir=code_dir(run_dir),
                  modules=tuple((modules or {}).items()))


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


