"""Shared fixtures: the real third-party data beside the repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """`../shared/data` beside the repository. CI has it and must use it (absent, the test
    fails there); a student's clone has none, and its tests skip with the reason."""
    if not SHARED_DATA.is_dir():
        why = f"real Kaldi data not found at {SHARED_DATA}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return SHARED_DATA


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A tiny built-in corpus (about 70 s of speech, 120 pdfs), made once per test session."""
    from labavg.data.synth import synthesize

    out = tmp_path_factory.mktemp("corpus") / "synth"
    synthesize(out, hours=0.02, seed=3)
    return out
