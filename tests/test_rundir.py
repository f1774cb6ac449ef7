"""relax_hpc/rundir.py's durability helpers."""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import pytest

from relax_hpc.errors import no_space
from relax_hpc.rundir import (FULL_BYTES, RESERVE_BYTES, RunFileError, create_run_dir, free_bytes, fsync_dir,
                              is_regular, mount_point, no_space_message, no_space_reason, read_json_file,
                              start_writeback, write_json, write_private)


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


def test_read_json_file_says_what_is_wrong_in_one_line_and_never_blocks(tmp_path):
    """What relax-status, the controller and the roles read a run file with: a regular file only (a FIFO is refused
    by its type, never opened for reading), at most ``limit`` bytes, and one line saying what is wrong."""
    f = tmp_path / "state.json"
    cases = [(b'{"a": 1}', None), (b"", "is empty"), (b"  \n", "holds only whitespace"),
             (b'\xff{"a": 1}', "is not UTF-8 text (byte 0xff at offset 0)"),
             (b'{"a": [1, 2', "is not valid JSON (Expecting ',' delimiter at line 1, column 12; it ends early"),
             (b'{"a": 1} x', "is not valid JSON (Extra data at line 1, column 10)"),
             (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
             (b"[1]", "holds an array where a JSON object should be"),
             (b"null", "holds null where a JSON object should be")]
    for data, words in cases:
        f.write_bytes(data)
        if words is None:
            assert read_json_file(f, dict) == {"a": 1}
            continue
        with pytest.raises(RunFileError) as e:
            read_json_file(f, dict)
        assert str(e.value).startswith(f"{f}: ") and words in str(e.value) and "\n" not in str(e.value), str(e.value)
    f.write_bytes(b'"' + b"x" * 100 + b'"')
    with pytest.raises(RunFileError, match="is 102 bytes, more than the 50"):
        read_json_file(f, limit=50)
    f.unlink()
    with pytest.raises(RunFileError, match="missing") as e:
        read_json_file(f)
    assert e.value.missing
    os.mkfifo(f)
    with pytest.raises(RunFileError, match=r"is a FIFO \(named pipe\), not a regular file"):
        read_json_file(f)
    assert not is_regular(f) and is_regular(__file__)
    with pytest.raises(RunFileError, match="is a device"):
        read_json_file("/dev/zero")  # would never end
    rd = create_run_dir(tmp_path, "r")
    assert rd.read_json(f, {"default": 1}) == {"default": 1}  # the tolerant reader of the controller and roles


def test_only_the_run_directorys_full_disk_is_the_runs(tmp_path, small_disk):
    """A full node-local disk (another filesystem, named by the error) is the node's: a restart may help there."""
    from relax_hpc.rundir import run_disk_full

    disk = small_disk(8)
    rd = create_run_dir(disk.path, "r")
    other = small_disk(1)
    on_run = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(rd.path / "exchange" / "chunk.h5"))
    on_node = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(other.path / "shm_seg"))
    text_only = RuntimeError("HDF5: write failed: No space left on device")
    assert run_disk_full(rd, on_run) and not run_disk_full(rd, on_node)
    assert not run_disk_full(rd, text_only)  # names no file, and the run's disk is not full: not the run's
    assert not run_disk_full(rd, ValueError("bad row"))
    disk.fill()
    assert run_disk_full(rd, text_only)  # now it is


# -- the recipe's secrets (RUN/secrets.json): which values, their masks, the file

def test_secrets_are_slurm_env_named_container_variables_and_notify_urls():
    from relax_hpc.rundir import MASK, secret_name, secret_overrides, split_secrets

    data = {"run": {"steps": 2},
            "slurm": {"env": {"HF_TOKEN": "tok", "OMP_NUM_THREADS": "1"},
                      "container": {"env": {"MY_API_KEY": "k", "NCCL_DEBUG": "INFO", "TOKENIZERS_PARALLELISM": "x"}}},
            "data": {"input_key": "prompt"},  # a recipe key named like a key is no secret: only env names count
            "logging": {"notify_urls": ["json://u:pw@host/x"]}}
    masked, found = split_secrets(data)
    assert found == {"slurm.env.HF_TOKEN": "tok", "slurm.env.OMP_NUM_THREADS": "1",
                     "slurm.container.env.MY_API_KEY": "k", "logging.notify_urls": ["json://u:pw@host/x"]}
    assert masked["slurm"]["env"] == {"HF_TOKEN": MASK, "OMP_NUM_THREADS": MASK}
    assert masked["slurm"]["container"]["env"] == {"MY_API_KEY": MASK, "NCCL_DEBUG": "INFO",
                                                   "TOKENIZERS_PARALLELISM": "x"}
    assert masked["logging"]["notify_urls"] == ["json://***"] and masked["data"] == {"input_key": "prompt"}
    assert data["slurm"]["env"]["HF_TOKEN"] == "tok"  # the caller's dict is left as it was
    assert split_secrets(masked) == (masked, {})  # a copy's masks are not secrets of their own
    assert secret_overrides(found)[0] == 'slurm.env.HF_TOKEN="tok"'
    assert [n for n in ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "hf_token", "APIKEY",
                        "TOKENIZERS_PARALLELISM", "KEYBOARD", "NCCL_DEBUG") if secret_name(n)] == \
        ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "hf_token", "APIKEY"]


@pytest.mark.parametrize("item,kept", [
    ("slurm.env.HF_TOKEN=tok", "slurm.env.HF_TOKEN=***"),
    ("slurm.env={HF_TOKEN: tok, B: c}", 'slurm.env={"HF_TOKEN": "***", "B": "***"}'),
    ("slurm={env: {A: tok}, partition: gpu}", 'slurm={"env": {"A": "***"}, "partition": "gpu"}'),
    ("slurm.container.env.MY_TOKEN=tok", "slurm.container.env.MY_TOKEN=***"),
    ("slurm.container.env.NCCL_DEBUG=INFO", "slurm.container.env.NCCL_DEBUG=INFO"),
    ("logging.notify_urls=[json://u:tok@h/x]", 'logging.notify_urls=["json://***"]'),
    ("logging.notify_urls=json://u:tok@h/x", "logging.notify_urls=json://***"),
    ("slurm.env.HF_TOKEN=[unclosed", "slurm.env.HF_TOKEN=***"),
    ("run.steps=2", "run.steps=2"), ("slurm.partition=gpu", "slurm.partition=gpu"),
])
def test_an_override_keeps_its_secret_out_of_job_json(item, kept):
    from relax_hpc.rundir import mask_override

    assert mask_override(item) == kept


def test_the_secrets_file_is_the_owners_and_a_damaged_one_is_refused(tmp_path):
    from relax_hpc.rundir import RunDir, read_secrets, write_secrets

    run = RunDir(tmp_path)
    assert read_secrets(run) == {}  # a run made before the file existed: its copy holds the values
    write_secrets(run, {"slurm.env.HF_TOKEN": "tok"})
    assert run.secrets_file.stat().st_mode & 0o777 == 0o600
    assert read_secrets(run) == {"slurm.env.HF_TOKEN": "tok"}
    run.secrets_file.write_text('{"recipe": ["x"]}')
    with pytest.raises(RunFileError, match="secrets.json: has no \"recipe\" object"):
        read_secrets(run)  # a run must not start without its secrets
