"""Fixtures of the controller tests: a real Channel (control socket server) on a kernel-chosen port."""

import pytest

from ctl_helpers import TOKEN
from relax_hpc.controller.channel import Channel


@pytest.fixture
def channel():
    ch = Channel(TOKEN, bind_host="127.0.0.1")
    yield ch
    ch.close()
