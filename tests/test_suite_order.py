"""The suite's file order (tests/conftest.py SLOWEST_FIRST) names files that exist, once each."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SLOWEST_FIRST


def test_every_slowest_first_file_exists_once():
    here = Path(__file__).resolve().parent
    assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST)
    missing = [name for name in SLOWEST_FIRST if not (here / name).is_file()]
    assert not missing, f"tests/conftest.py SLOWEST_FIRST names missing files: {missing}"
