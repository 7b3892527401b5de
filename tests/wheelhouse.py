"""Wheels for an offline install, repacked from the distributions installed here.

    path = build_wheelhouse(["podracer-rl[gcs]", "uv", "jax[tpu]==0.10.2"],
                            exclude=["podracer-rl", "libtpu"])
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(path),
           "UV_OFFLINE": "1", "UV_NO_INDEX": "1", "UV_FIND_LINKS": str(path)}

The test machine has no index to install from, so a test that installs a
worker's environment as a TPU VM would (pip, uv, a lock of `name==version`
lines) points pip and uv at a wheelhouse: a wheel for every distribution in
the transitive closure of the requirements, as installed in this environment
(extras and environment markers evaluated for this interpreter; every
installed version must satisfy what asks for it).

Each wheel is rebuilt from the installed files that the distribution's RECORD
lists. Files installed outside site-packages go back to the wheel's `.data`
directory: under the scripts directory (`../../../bin/uv`) to
`NAME-VERSION.data/scripts/`, under the prefix (`../../../share/...`) to
`.data/data/`. Left out: what the installer wrote (INSTALLER, REQUESTED,
direct_url.json, the console-script wrappers it generates from
entry_points.txt, `__pycache__`), and the RECORD, written afresh with sha256
hashes. A script the installer gave this interpreter's `#!` gets `#!python`
back. The file name's tags are the WHEEL file's tags, compressed
(`py2.py3-none-any`), the form pip and uv read.

`exclude` names distributions left out of the wheelhouse: their wheel comes
from elsewhere (the project's own, built by `pip wheel`), or they cannot be
installed here (`libtpu`, which `jax[tpu]` asks for: the installers are told
to leave it out). An excluded distribution that is installed still brings its
dependencies in; one that is not installed brings nothing.

The result is cached: `<tempdir>/podracer-test-wheelhouse-<hash of the
closure's names and versions>`, built in a temporary directory beside it and
renamed into place, under a file lock, so concurrent test processes build it
once and never see half of it.
"""

from __future__ import annotations

import base64
import contextlib
import email.parser
import fcntl
import hashlib
import importlib.metadata as metadata
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

FORMAT = 1  # bump when the wheels' contents change, to leave old caches behind
PREFIX = "podracer-test-wheelhouse-"
_INSTALLER_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD", "RECORD.jws", "RECORD.p7s"}
_CHUNK = 1 << 20


class WheelhouseError(Exception):
    pass


def closure(requirements: list[str], exclude=()) -> dict[str, str]:
    """`{canonical name: installed version}` of the distributions the wheelhouse holds."""
    excluded = {canonicalize_name(name) for name in exclude}
    return {name: dist.version for name, dist in _closure(requirements, excluded).items()
            if name not in excluded}


def build_wheelhouse(requirements: list[str], *, exclude=(), root: str | os.PathLike | None = None,
                     compression: int = zipfile.ZIP_STORED) -> Path:
    """The directory of wheels for `requirements` (see the module's docstring), built once."""
    excluded = {canonicalize_name(name) for name in exclude}
    dists = {name: dist for name, dist in _closure(requirements, excluded).items()
             if name not in excluded}
    key = json.dumps([FORMAT, sys.implementation.cache_tag, sysconfig.get_platform(), compression,
                      sorted((name, dist.version) for name, dist in dists.items())])
    root = Path(root or tempfile.gettempdir())
    final = root / (PREFIX + hashlib.sha256(key.encode()).hexdigest()[:16])
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / (final.name + ".lock")):
        if final.is_dir():  # another process built it while this one waited
            return final
        building = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
                list(pool.map(lambda dist: repack(dist, building, compression), dists.values()))
            os.rename(building, final)
        except OSError:
            shutil.rmtree(building, ignore_errors=True)
            if not final.is_dir():
                raise
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
    return final


def repack(dist: metadata.Distribution, directory: Path,
           compression: int = zipfile.ZIP_STORED) -> Path:
    """Write the installed `dist` as a wheel into `directory`; its path."""
    name = dist.metadata["Name"]
    files = dist.files
    if files is None:
        raise WheelhouseError(f"{name} {dist.version} has no RECORD (not installed from a wheel)")
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct_url.get("dir_info", {}).get("editable"):
        raise WheelhouseError(f"{name} is installed editable: build its wheel instead, and exclude it")
    wheel = email.parser.Parser().parsestr(dist.read_text("WHEEL") or "")
    tags = wheel.get_all("Tag") or []
    if not tags:
        raise WheelhouseError(f"{name} {dist.version}: its WHEEL file names no tag")
    parts = [tag.split("-") for tag in tags]
    compressed = "-".join(".".join(dict.fromkeys(part[i] for part in parts)) for i in range(3))
    build = f"-{wheel['Build']}" if wheel["Build"] else ""
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{Version(dist.version)}"
    target = directory / f"{stem}{build}-{compressed}.whl"

    base = Path(dist.locate_file("")).resolve()
    dist_info = next(str(f).split("/")[0] for f in files if str(f).endswith(".dist-info/METADATA"))
    data_dir = dist_info[: -len(".dist-info")] + ".data"
    wrappers = {ep.name for ep in dist.entry_points if ep.group in ("console_scripts", "gui_scripts")}
    paths = sysconfig.get_paths()
    schemes = [(scheme, Path(paths[scheme]).resolve())
               for scheme in ("scripts", "purelib", "platlib", "data")]

    members: list[tuple[str, Path, bool]] = []  # (name in the wheel, file, is a script)
    for file in files:
        relative = str(file)
        if "__pycache__" in relative.split("/"):
            continue
        if relative.startswith(dist_info + "/") and relative[len(dist_info) + 1:] in _INSTALLER_FILES:
            continue
        source = Path(os.path.normpath(base / relative))
        if not relative.startswith("../"):
            members.append((relative, source, False))
            continue
        for scheme, scheme_dir in schemes:
            inside = os.path.relpath(source, scheme_dir)
            if not inside.startswith(".."):
                break
        else:
            raise WheelhouseError(f"{name}: {relative} is outside every install directory")
        if scheme == "scripts" and inside in wrappers:
            continue  # the installer writes it again from entry_points.txt
        members.append((f"{data_dir}/{scheme}/{inside}", source, scheme == "scripts"))
    members.sort(key=lambda member: member[0].startswith(dist_info + "/"))  # dist-info last

    record = []
    with zipfile.ZipFile(target, "w", compression=compression) as archive:
        for arcname, source, script in members:
            if not source.is_file():
                raise WheelhouseError(f"{name}: {source} is in its RECORD but missing")
            digest, size = _add(archive, arcname, source, script)
            record.append(f"{arcname},sha256={digest},{size}")
        record.append(f"{dist_info}/RECORD,,")
        info = zipfile.ZipInfo(f"{dist_info}/RECORD", date_time=(1980, 1, 1, 0, 0, 0))
        info.external_attr = 0o644 << 16
        archive.writestr(info, "\n".join(record) + "\n", compress_type=compression)
    return target


def _closure(requirements: list[str], excluded: set[str]) -> dict[str, metadata.Distribution]:
    """Every distribution the requirements reach, first found first, checked against what asks."""
    found: dict[str, metadata.Distribution] = {}
    done: dict[str, set[str]] = {}  # name -> extras ("" for the base) whose requirements were read
    queue = [(Requirement(text), "the requirements") for text in requirements]
    while queue:
        requirement, parent = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if name not in found:
            try:
                found[name] = metadata.distribution(name)
            except metadata.PackageNotFoundError:
                if name in excluded:
                    continue
                raise WheelhouseError(f"{requirement} (asked for by {parent}) is not installed here; "
                                      f"install it, or exclude {name!r}") from None
        dist = found[name]
        if not requirement.specifier.contains(dist.version, prereleases=True):
            raise WheelhouseError(f"{parent} asks for {requirement}, but {name} {dist.version} "
                                  "is installed")
        extras = ({""} | {canonicalize_name(extra) for extra in requirement.extras})
        todo = extras - done.setdefault(name, set())
        if not todo:
            continue
        done[name] |= todo
        for text in dist.requires or []:
            child = Requirement(text)
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in todo):
                child.marker = None
                queue.append((child, f"{name} {dist.version}"))
    return found


def _add(archive: zipfile.ZipFile, arcname: str, source: Path, script: bool) -> tuple[str, int]:
    """Copy `source` in as `arcname`, hashing on the way; (urlsafe sha256, size)."""
    stat = source.stat()
    info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
    info.external_attr = (stat.st_mode & 0xFFFF) << 16
    info.compress_type = archive.compression
    sha = hashlib.sha256()
    size = 0
    with open(source, "rb") as src, archive.open(info, "w", force_zip64=stat.st_size > 1 << 30) as dst:
        first = True
        while chunk := src.read(_CHUNK):
            if first and script and chunk.startswith(b"#!"):
                line, newline, rest = chunk.partition(b"\n")
                if re.fullmatch(rb"#!\S*python[\w.]*(\s.*)?", line.rstrip(b"\r")):
                    chunk = b"#!python" + newline + rest
            first = False
            sha.update(chunk)
            size += len(chunk)
            dst.write(chunk)
    digest = base64.urlsafe_b64encode(sha.digest()).rstrip(b"=").decode()
    return digest, size


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
