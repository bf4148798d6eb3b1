"""Shared fixtures: the real third-party data beside the repository."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """`../shared/data` beside the repository (CI has it); skip with a reason when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real Kaldi data not found at {SHARED_DATA}")
    return SHARED_DATA
