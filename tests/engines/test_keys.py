"""Key files of external engines (relax_hpc.engines.keys): read only when private to their owner, with the fix named
otherwise; URLs checked before anything is asked of them."""

from __future__ import annotations

import pytest

from relax_hpc.engines.keys import KeyFileError, check_url, read_key_file


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_key_file_is_read(tmp_path, mode):
    p = tmp_path / "k"
    p.write_text("  s3cret \n")
    p.chmod(mode)
    assert read_key_file(p) == "s3cret"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_key_file_others_can_read_is_refused_with_the_fix(tmp_path, mode):
    p = tmp_path / "k"
    p.write_text("s3cret\n")
    p.chmod(mode)
    with pytest.raises(KeyFileError, match=f"--key-file {p}: mode {mode:04o}, readable by others than its owner; "
                                           f"an engine key must be private. Fix: chmod 600 {p}"):
        read_key_file(p)


def test_absent_empty_or_odd_key_files_are_refused(tmp_path):
    with pytest.raises(KeyFileError, match="cannot be read"):
        read_key_file(tmp_path / "none", "rollout.external_engines[0].key_file")
    with pytest.raises(KeyFileError, match="not a regular file"):
        read_key_file(tmp_path)
    for text, why in (("\n", "empty"), ("a\nb\n", "more than one line")):
        p = tmp_path / "k"
        p.write_text(text)
        p.chmod(0o600)
        with pytest.raises(KeyFileError, match=why):
            read_key_file(p)


def test_urls():
    assert check_url("http://gpu-3:30000/") == "http://gpu-3:30000"
    assert check_url("https://10.0.0.2:443") == "https://10.0.0.2:443"
    for bad in ("gpu-3:30000", "http://gpu-3", "ftp://gpu-3:1", "http://gpu-3:30000/generate", "http://gpu-3:x"):
        with pytest.raises(ValueError, match="expected http://HOST:PORT"):
            check_url(bad)
