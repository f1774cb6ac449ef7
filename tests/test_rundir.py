"""relax_hpc/rundir.py's durability helpers."""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import pytest

from relax_hpc.errors import no_space
from relax_hpc.rundir import (FULL_BYTES, RESERVE_BYTES, create_run_dir, free_bytes, fsync_dir, mount_point,
                              no_space_message, no_space_reason, start_writeback, write_json, write_private)


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


# ------------------------------------------------------------------------------------------- a full disk ---

def test_a_new_run_directory_holds_its_reserve_until_released(tmp_path):
    rd = create_run_dir(tmp_path / "runs", "r")
    st = rd.reserve.stat()
    assert st.st_blocks * 512 >= RESERVE_BYTES and st.st_mode & 0o777 == 0o600  # blocks held, not a sparse file
    assert rd.release_reserve() >= RESERVE_BYTES and not rd.reserve.exists()
    assert rd.release_reserve() == 0  # released twice: nothing more to free, no error
    assert rd.ensure_reserve() and rd.reserve.stat().st_blocks * 512 >= RESERVE_BYTES  # a resume makes it again


def test_on_a_full_disk_a_write_fails_whole_and_the_reserve_makes_room(tmp_path, small_disk):
    disk = small_disk(8)
    rd = create_run_dir(disk.path / "runs", "r")
    write_json(rd.state, {"state": "RUNNING"})
    disk.fill()
    with pytest.raises(OSError) as err:
        write_json(rd.state, {"state": "FAILED"})
    assert no_space(err.value) is not None
    assert rd.read_json(rd.state) == {"state": "RUNNING"}  # the old file stands
    assert [p.name for p in rd.path.iterdir() if p.name.endswith(".tmp")] == []  # nothing left to hold space
    assert rd.ensure_reserve(RESERVE_BYTES * 2) is False and not list(rd.path.glob(".reserve.*"))

    assert rd.release_reserve() >= RESERVE_BYTES
    big = "x" * (RESERVE_BYTES + (1 << 20))  # more than was freed: the disk fills part way through the write
    with pytest.raises(OSError):
        write_private(rd.state, big)  # a short write is not taken for the whole (it would truncate the file)
    assert rd.read_json(rd.state) == {"state": "RUNNING"}
    write_json(rd.state, {"state": "FAILED"})  # what the reserve is for: the run's last words
    assert rd.read_json(rd.state) == {"state": "FAILED"}


def test_the_no_space_reason_names_the_mount_point_the_file_and_the_fix(tmp_path, small_disk):
    disk = small_disk(1)
    rd = create_run_dir(disk.path / "runs", "r")
    assert mount_point(rd.path / "not" / "yet") == disk.path
    msg = no_space_message(rd, rd.state, "No space left on device")
    assert msg == (f"no space left on {disk.path} (writing {rd.state}; No space left on device). Fix: free space on "
                   f"{disk.path} (or raise the quota), then relax-submit --resume {rd.path}")
    disk.fill()
    with pytest.raises(OSError) as err:
        (rd.path / "big").write_bytes(b"x" * 8192)
    assert no_space_reason(rd, err.value).startswith(f"no space left on {disk.path} (No space left on device). ")
    assert no_space_reason(rd, err.value, rd.state).startswith(f"no space left on {disk.path} (writing {rd.state}; ")
    assert free_bytes(disk.path) < FULL_BYTES


def test_the_no_space_reason_is_one_line_whatever_the_library_put_in_the_error(tmp_path):
    rd = create_run_dir(tmp_path / "runs", "r")
    hdf5 = OSError(errno.ENOSPC, "Can't close file (file write failed: time = Thu Nov 26\n, filename = 'x.h5', "
                   "errno = 28, error message = 'No space left on device', buf = 0x55)")
    assert no_space_reason(rd, hdf5) == no_space_message(rd, None, "No space left on device")
    torch = RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0\nNo space left on device")
    assert no_space_reason(rd, torch) == no_space_message(rd, None, "No space left on device")
