"""Notebooks are committed without outputs, whatever JupyterLab's autosave wrote into them: the
nbstripout filter that .gitattributes names and scripts/git-notebook-filter.sh sets up (run by
scripts/setup.sh), and the tracked notebooks already stripped by the same command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_tracked_notebooks_are_what_the_filter_would_store():
    verify = subprocess.run([sys.executable, "-m", "nbstripout", "--verify", "--keep-id", *map(str, NOTEBOOKS)],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "*.ipynb filter=nbstripout" in (REPO / ".gitattributes").read_text()
    assert ".ipynb_checkpoints/" in (REPO / ".gitignore").read_text().splitlines()
    assert "scripts/git-notebook-filter.sh" in (REPO / "scripts" / "setup.sh").read_text()


def test_an_autosaved_notebook_is_committed_without_its_outputs(tmp_path):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "class@example.org")
    _git(tmp_path, "config", "user.name", "class")
    shutil.copy(REPO / ".gitattributes", tmp_path / ".gitattributes")
    subprocess.run(["bash", str(REPO / "scripts" / "git-notebook-filter.sh")], cwd=tmp_path, check=True,
                   env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    tracked = NOTEBOOKS[2]
    notebook = json.loads(tracked.read_text())
    code = next(c for c in notebook["cells"] if c["cell_type"] == "code")
    code["execution_count"] = 7
    code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["a class's run\n"]}]
    (tmp_path / tracked.name).write_text(json.dumps(notebook, indent=1))
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "autosaved")
    stored = json.loads(_git(tmp_path, "show", f"HEAD:{tracked.name}"))
    assert stored == json.loads(tracked.read_text()), "stored as the tracked notebook, ids kept"
    assert "a class's run" in (tmp_path / tracked.name).read_text(), "the working copy keeps its outputs"
    assert _git(tmp_path, "status", "--porcelain") == "", "the autosaved copy is not a change"
