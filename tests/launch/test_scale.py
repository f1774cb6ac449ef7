"""relax-scale's external-engine requests (relax_hpc.launch.scale, the CLI in launch/cli.py): the key file is checked
here before anything is sent, and only its absolute path travels; a key is never taken on the command line."""

from __future__ import annotations

import pytest

from relax_hpc.launch.cli import scale_main
from relax_hpc.launch.scale import ScaleError, scale
from relax_hpc.rundir import create_run_dir


def test_the_key_file_is_checked_before_the_controller_is_asked(tmp_path):
    rd = create_run_dir(tmp_path / "runs", "r")  # no controller: the key file's error comes first
    key = tmp_path / "k"
    key.write_text("s3cret\n")
    key.chmod(0o644)
    with pytest.raises(ScaleError, match=f"mode 0644.*Fix: chmod 600 {key}"):
        scale(rd, None, attach_url="http://127.0.0.1:5", key_file=str(key))
    with pytest.raises(ScaleError, match="needs --key-file FILE"):
        scale(rd, None, attach_url="http://127.0.0.1:5")
    key.chmod(0o600)
    with pytest.raises(ScaleError, match="expected http://HOST:PORT"):
        scale(rd, None, attach_url="127.0.0.1:5", key_file=str(key))
    with pytest.raises(ScaleError, match="has no running controller"):  # a good request gets as far as the run
        scale(rd, None, attach_url="http://127.0.0.1:5", key_file=str(key))
    with pytest.raises(ScaleError, match="has no running controller"):
        scale(rd, None, drain_url="http://127.0.0.1:5")


@pytest.mark.parametrize("argv, why", [
    (["r", "--attach-url", "http://h:1"], "--attach-url URL and --key-file FILE go together"),
    (["r", "rollout=+1", "--key-file", "k"], "--attach-url URL and --key-file FILE go together"),
    (["r", "rollout=+1", "--drain", "http://h:1"], "give one of"),
    (["r", "--attach-url", "http://h:1", "--api-key", "s3cret"], "unrecognized arguments"),  # no way to pass a key
])
def test_the_cli_refuses_mixed_or_keyed_requests(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        scale_main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err
