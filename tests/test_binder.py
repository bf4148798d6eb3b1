"""binder/ (repo2docker) is consistent with pyproject.toml and the notebooks."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
BINDER = REPO / "binder"
# Binder images are Linux: evaluate environment markers as there.
LINUX = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux"}


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _binder_requirements() -> tuple[dict[str, Requirement], list[str]]:
    """Requirements of binder/requirements.txt by canonical name, and its pip option lines."""
    reqs: dict[str, Requirement] = {}
    options = []
    for line in (BINDER / "requirements.txt").read_text().splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            options.append(line)
            continue
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name not in reqs, f"binder/requirements.txt lists {name} twice"
        reqs[name] = req
    return reqs, options


def _versions_named(spec: SpecifierSet) -> list[Version]:
    """The versions a specifier pins or starts from (==, ===, >=, ~=)."""
    return [Version(s.version) for s in spec if s.operator in ("==", "===", ">=", "~=")]


def test_binder_files_exist_and_scripts_are_executable():
    for name in ("requirements.txt", "runtime.txt", "postBuild", "start"):
        assert (BINDER / name).is_file(), f"binder/{name} missing"
    for name in ("postBuild", "start"):
        assert os.access(BINDER / name, os.X_OK), f"binder/{name} must be executable"
        assert (BINDER / name).read_text().startswith("#!/bin/bash")
    # repo2docker's start script must hand over to the server command
    assert (BINDER / "start").read_text().rstrip().endswith('exec "$@"')


def test_python_version_satisfies_requires_python():
    runtime = (BINDER / "runtime.txt").read_text().strip()
    match = re.fullmatch(r"python-(\d+\.\d+)", runtime)
    assert match, f"binder/runtime.txt: expected python-X.Y, got {runtime!r}"
    requires = SpecifierSet(_pyproject()["project"]["requires-python"])
    assert requires.contains(match.group(1)), f"{runtime} is outside requires-python {requires}"
    assert Version(match.group(1)) >= Version("3.11"), "labavg reads TOML with tomllib (3.11+)"


def test_every_runtime_dependency_is_satisfied_by_binder():
    binder, _ = _binder_requirements()
    for line in _pyproject()["project"]["dependencies"]:
        dep = Requirement(line)
        if dep.marker is not None and not dep.marker.evaluate(LINUX):
            continue
        name = canonicalize_name(dep.name)
        assert name in binder, f"pyproject dependency {line!r} is not in binder/requirements.txt"
        named = _versions_named(binder[name].specifier)
        assert named, f"binder/requirements.txt: give {name} a lower bound or pin"
        for version in named:
            # every version binder allows must start at or above what pyproject needs
            assert dep.specifier.contains(version, prereleases=True), (
                f"binder's {binder[name]} allows {version}, outside pyproject's {dep}")


def test_torch_is_the_cpu_build_pinned_once():
    binder, options = _binder_requirements()
    torch = binder["torch"]
    pins = [s for s in torch.specifier if s.operator == "=="]
    assert len(pins) == 1 and pins[0].version.endswith("+cpu"), f"pin the CPU wheel, got {torch}"
    assert any("download.pytorch.org/whl/cpu" in o for o in options), "the CPU wheel index is needed"
    # nothing else may install another torch behind the pin's back
    post = (BINDER / "postBuild").read_text()
    assert "--no-deps" in post and "pip install" in post
    assert not re.search(r"pip install[^\n]*\btorch\b", post)
    assert SpecifierSet(next(r for r in _pyproject()["project"]["dependencies"]
                             if r.startswith("torch"))[len("torch"):]).contains(
        Version(pins[0].version), prereleases=True)


def test_postbuild_installs_the_package_and_mpich_provides_mpi():
    post = (BINDER / "postBuild").read_text()
    assert re.search(r"pip install --no-deps -e \.", post)
    binder, _ = _binder_requirements()
    assert {"mpich", "mpi4py", "ipyparallel", "jupyterlab"} <= set(binder)


def test_dashboard_proxy_is_configured():
    binder, _ = _binder_requirements()
    assert {"jupyter-server-proxy", "jupyter-panel-proxy", "panel"} <= set(binder)
    config = (BINDER / "jupyter-panel-proxy.yml").read_text()
    apps = re.findall(r"^\s*-\s*(\S+)\s*$", config, flags=re.M)
    assert apps and all((REPO / app).is_file() for app in apps), f"apps {apps} must exist"
    assert "cp binder/jupyter-panel-proxy.yml jupyter-panel-proxy.yml" in (BINDER / "postBuild").read_text()
    readme = (REPO / "notebooks" / "README.md").read_text()
    # the documented URL path is the app's file name under /panel
    for app in apps:
        assert f"/panel/{Path(app).stem}" in readme


def test_referenced_notebooks_exist():
    texts = [(BINDER / name).read_text() for name in ("start", "postBuild", "requirements.txt")]
    texts.append((REPO / "notebooks" / "README.md").read_text())
    referenced = set()
    for text in texts:
        referenced |= set(re.findall(r"notebooks/[\w.-]+\.ipynb", text))
        referenced |= {f"notebooks/{n}" for n in re.findall(r"\]\(([\w.-]+\.ipynb)\)", text)}
    assert "notebooks/01-data-and-kaldi-formats.ipynb" in referenced, "Binder opens the first notebook"
    for path in referenced:
        assert (REPO / path).is_file(), f"{path} is referenced but missing"
    urlpaths = re.findall(r"urlpath=lab/tree/(\S+\.ipynb)", texts[-1])
    assert urlpaths and all((REPO / p).is_file() for p in urlpaths)
