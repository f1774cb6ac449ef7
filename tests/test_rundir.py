"""relax_hpc/rundir.py's durability helpers."""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import pytest

from relax_hpc.rundir import fsync_dir, start_writeback


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_start_writeback_hands_a_written_range_to_the_kernel(tmp_path):
    # the chunk writer relies on it to overlap the device's writing with its copying: on Linux it must be found
    # and taken, not silently skipped
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * (1 << 20))
        taken = start_writeback(fd, 0, 1 << 20)
        if not taken and ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            pytest.skip("this sandbox refuses sync_file_range")  # (seccomp, WSL1): the writer then just fsyncs
        assert taken
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(tmp_path)
    assert path.read_bytes() == b"x" * (1 << 20)


def test_start_writeback_never_raises_where_the_kernel_refuses(tmp_path):
    r, w = os.pipe()  # sync_file_range does not apply to a pipe (ESPIPE): the writer goes on, fsync does the rest
    try:
        assert start_writeback(w, 0, 1) is False
    finally:
        os.close(r)
        os.close(w)
