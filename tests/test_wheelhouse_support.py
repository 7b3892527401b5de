"""The test wheelhouse: wheels repacked from this environment install offline, with pip and with uv."""

import base64
import hashlib
import importlib.metadata as metadata
import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests import wheelhouse
from tests.wheelhouse import WheelhouseError, build_wheelhouse, closure

# six: pure Python with two tags (py2.py3); charset-normalizer: compiled, with a
# console script; uv: a binary under .data/scripts, installed as the worker does.
SMALL = ["six", "charset-normalizer", "uv"]


def offline_env(wheels, tmp_path):
    """pip and uv told, through their own variables, to install from `wheels` alone."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "UV_")) and k != "VIRTUAL_ENV"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels),
               PIP_DISABLE_PIP_VERSION_CHECK="1",
               UV_NO_CONFIG="1", UV_OFFLINE="1", UV_NO_INDEX="1", UV_FIND_LINKS=str(wheels),
               UV_PYTHON_DOWNLOADS="never", UV_CACHE_DIR=str(tmp_path / "uv-cache"))
    return env


def run(args, env):
    out = subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{args}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_repacked_wheels_install_offline_with_pip_and_uv(tmp_path, monkeypatch):
    path = build_wheelhouse(SMALL, root=tmp_path / "cache")
    versions = {name: metadata.version(name) for name in SMALL}
    assert closure(SMALL) == versions
    wheels = {w.name: w for w in path.iterdir()}
    cp = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert len(wheels) == 3
    assert f"six-{versions['six']}-py2.py3-none-any.whl" in wheels  # both tags, compressed
    assert [n for n in wheels if n.startswith(f"charset_normalizer-{versions['charset-normalizer']}"
                                              f"-{cp}-{cp}-manylinux")]
    assert [n for n in wheels if n.startswith(f"uv-{versions['uv']}-py3-none-manylinux")]
    for wheel in wheels.values():
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            assert not [n for n in names if "__pycache__" in n
                        or n.endswith(("/INSTALLER", "/REQUESTED", "/direct_url.json"))]
            record = archive.read(next(n for n in names if n.endswith(".dist-info/RECORD")))
            rows = [line.split(",") for line in record.decode().splitlines()]
            assert sorted(row[0] for row in rows) == sorted(names)
            for name, digest, size in rows:
                if digest:
                    data = archive.read(name)
                    sha = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                    assert (digest, int(size)) == (f"sha256={sha.decode()}", len(data)), name
    uv_names = zipfile.ZipFile(next(w for n, w in wheels.items() if n.startswith("uv-"))).namelist()
    assert f"uv-{versions['uv']}.data/scripts/uv" in uv_names
    charset_names = zipfile.ZipFile(next(w for n, w in wheels.items()
                                         if n.startswith("charset"))).namelist()
    assert not [n for n in charset_names if ".data/" in n]  # the `normalizer` wrapper is regenerated

    # Built once: a second call finds it without repacking anything.
    monkeypatch.setattr(wheelhouse, "repack", lambda *a: pytest.fail("repacked again"))
    assert build_wheelhouse(SMALL, root=tmp_path / "cache") == path
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] == [path.name]

    env = offline_env(path, tmp_path)
    # pip, into a fresh venv.
    run([sys.executable, "-m", "venv", tmp_path / "pip-venv"], env)
    python = tmp_path / "pip-venv" / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", "six", "charset-normalizer"], env)
    run([python, "-c", "import six, charset_normalizer.md"], env)
    assert "Charset-Normalizer" in run([tmp_path / "pip-venv" / "bin" / "normalizer", "--version"], env)

    # uv as the worker gets it: pip --target, then a uv venv and `uv pip install`.
    run([sys.executable, "-m", "pip", "install", "-q", "--target", tmp_path / "uv",
         f"uv=={versions['uv']}"], env)
    uv = tmp_path / "uv" / "bin" / "uv"
    assert run([uv, "--version"], env).startswith(f"uv {versions['uv']}")
    run([uv, "venv", "-q", "--clear", "--python", sys.executable, tmp_path / "uv-venv"], env)
    python = tmp_path / "uv-venv" / "bin" / "python"
    run([uv, "pip", "install", "-q", "--python", python, "six", "charset-normalizer"], env)
    assert run([python, "-c", "import six, charset_normalizer; print(charset_normalizer.__version__)"],
               env).strip() == versions["charset-normalizer"]


def test_closure_follows_extras_and_excludes():
    jax = metadata.version("jax")
    with pytest.raises(WheelhouseError, match="libtpu"):
        closure([f"jax[tpu]=={jax}"])
    names = closure([f"jax[tpu]=={jax}"], exclude=["libtpu"])
    assert {"jax", "jaxlib", "requests", "numpy", "urllib3"} <= set(names)
    assert "libtpu" not in names
    assert "requests" not in closure([f"jax=={jax}"])  # only the extra asks for it

    # An excluded distribution that is installed still brings in its dependencies.
    assert closure(["charset-normalizer", "six"], exclude=["six"]) == \
        {"charset-normalizer": metadata.version("charset-normalizer")}
    with pytest.raises(WheelhouseError, match="six .* is installed"):
        closure(["six<1"])


def fake_distribution(site, name, requires=(), files=None, entry_points=""):
    """A distribution installed in `site` (which its `requires` need not be), with more `files`."""
    module = name.replace("-", "_")
    dist_info = f"{module}-1.0.dist-info"
    files = {f"{module}.py": "VALUE = 1\ndef main():\n    print('cli', VALUE)\n", **(files or {}),
             f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
             + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{dist_info}/INSTALLER": "pip\n"}
    if entry_points:
        files[f"{dist_info}/entry_points.txt"] = entry_points
    for relative, text in files.items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_text(text)
    (site / dist_info / "RECORD").write_text("".join(f"{r},,\n" for r in [*files, f"{dist_info}/RECORD"]))
    return metadata.PathDistribution(site / dist_info)


def test_files_outside_site_packages_go_back_to_the_data_directory(tmp_path, monkeypatch):
    uv = os.path.join(sysconfig.get_paths()["scripts"], "uv")
    prefix = tmp_path / "prefix"
    site = prefix / "lib" / "site-packages"
    dist = fake_distribution(site, "tools", files={
        "../../bin/tool": f"#!{sys.executable}\nimport tools\nprint('tool', tools.VALUE)\n",
        "../../bin/tools-cli": f"#!{sys.executable}\n# the wrapper pip wrote\n",
        "../../share/tools/notes.txt": "notes\n",
    }, entry_points="[console_scripts]\ntools-cli = tools:main\n")
    monkeypatch.setattr(wheelhouse.sysconfig, "get_paths", lambda: {
        "scripts": str(prefix / "bin"), "purelib": str(site), "platlib": str(site),
        "data": str(prefix)})
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheelhouse.repack(dist, wheels)
    monkeypatch.undo()
    assert wheel.name == "tools-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        assert sorted(archive.namelist()) == [
            "tools-1.0.data/data/share/tools/notes.txt", "tools-1.0.data/scripts/tool",
            "tools-1.0.dist-info/METADATA", "tools-1.0.dist-info/RECORD",
            "tools-1.0.dist-info/WHEEL", "tools-1.0.dist-info/entry_points.txt", "tools.py"]
        assert archive.read("tools-1.0.data/scripts/tool").startswith(b"#!python\nimport tools")

    env = offline_env(wheels, tmp_path)
    venv = tmp_path / "venv"
    run([uv, "venv", "-q", "--python", sys.executable, venv], env)
    run([uv, "pip", "install", "-q", "--python", venv / "bin" / "python", "tools"], env)
    assert run([venv / "bin" / "tool"], env) == "tool 1\n"
    assert run([venv / "bin" / "tools-cli"], env) == "cli 1\n"
    assert (venv / "share" / "tools" / "notes.txt").read_text() == "notes\n"


@pytest.mark.parametrize("how", ["UV_OVERRIDE", "UV_EXCLUDE"])
def test_uv_leaves_out_a_dependency_that_cannot_be_installed(tmp_path, how):
    """As the worker leaves out libtpu on a machine without one: the documented variables, tried."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheelhouse.repack(fake_distribution(tmp_path / "site", "needs-absent", ["absent-dependency>=1"]),
                      wheels)
    uv = os.path.join(sysconfig.get_paths()["scripts"], "uv")  # the dev extra's
    env = offline_env(wheels, tmp_path)
    run([uv, "venv", "-q", "--python", sys.executable, tmp_path / "venv"], env)
    install = [uv, "pip", "install", "-q", "--python", tmp_path / "venv" / "bin" / "python",
               "needs-absent==1.0"]
    refused = subprocess.run([str(a) for a in install], env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and "absent-dependency" in refused.stderr

    rule = tmp_path / "rule.txt"
    if how == "UV_OVERRIDE":  # an override's marker replaces the dependency's, true or false
        rule.write_text("absent-dependency ; sys_platform == 'never'\n")
    else:
        rule.write_text("absent-dependency\n")
    run(install, dict(env, **{how: str(rule)}))
    run([tmp_path / "venv" / "bin" / "python", "-c", "import needs_absent"], env)
