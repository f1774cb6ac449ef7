"""Exchange test fixtures: real files, on tmpfs where there is one (fsync is real but cheap there)."""

from __future__ import annotations

import shutil

import pytest

from .helpers import fresh_dir


@pytest.fixture
def xroot():
    d = fresh_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)
