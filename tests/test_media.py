"""The files and URLs a data row may name (relax_hpc/media.py): only under the dataset's directory and
``data.media_roots`` (symlinks resolved), never a FIFO or more than the byte bound, URLs only when allowed and then
bounded; every refusal names the path or URL, never what the file holds."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax_hpc.media import TRUSTED, MediaError, MediaPolicy, fetch_url, read_file, resolve

CANARY = "CANARY-6f1d-secret-contents"


@pytest.fixture
def tree(tmp_path):
    """A dataset directory ``ds`` (with ``ok.bin``, a symlink inside it and one leading out), and a sibling
    ``secret`` holding a canary file."""
    (tmp_path / "ds" / "sub").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    (tmp_path / "ds" / "sub" / "ok.bin").write_bytes(b"ok")
    (tmp_path / "secret" / "x").write_text(CANARY)
    os.symlink(tmp_path / "secret" / "x", tmp_path / "ds" / "out.bin")
    os.symlink(tmp_path / "ds" / "sub" / "ok.bin", tmp_path / "ds" / "in.bin")
    return tmp_path


def test_paths_resolve_only_under_the_dataset_directory_and_the_roots(tree):
    ds = MediaPolicy(base_dir=tree / "ds")
    assert resolve("sub/ok.bin", ds) == (tree / "ds" / "sub" / "ok.bin").resolve()
    assert resolve(str(tree / "ds" / "sub" / "ok.bin"), ds).name == "ok.bin"  # absolute, inside: fine
    assert resolve("in.bin", ds).name == "ok.bin"  # a symlink that stays inside
    for ref in ("../secret/x", "/etc/shadow", "out.bin", "sub/../../secret/x", "/no/such/file"):
        with pytest.raises(MediaError) as e:
            resolve(ref, ds)
        msg = str(e.value)
        assert repr(ref) in msg and "outside the dataset's directory" in msg and "data.media_roots" in msg, msg
        assert CANARY not in msg
    # an outside path that exists and one that does not read alike: the message says nothing of the node's files
    a, b = (str(pytest.raises(MediaError, resolve, p, ds).value) for p in ("/etc/passwd", "/etc/no-such-file"))
    assert a.replace("passwd", "X") == b.replace("no-such-file", "X")
    # the roots the recipe lists open their directories (the symlink's target too)
    rooted = MediaPolicy(base_dir=tree / "ds", roots=(tree / "secret",))
    assert read_file(resolve("out.bin", rooted), 100) == CANARY.encode()
    assert read_file(resolve("../secret/x", rooted), 100) == CANARY.encode()
    # a trusted caller (the engine's keyed requests) reads paths anywhere
    assert resolve(str(tree / "secret" / "x"), TRUSTED) == tree / "secret" / "x"


def test_read_file_takes_regular_files_within_the_bound(tree):
    fifo = tree / "ds" / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(MediaError, match="not a regular file"):  # opened non-blocking: refused, not waited on
        read_file(fifo, 100)
    with pytest.raises(MediaError, match="over the 5 bytes"):
        read_file(tree / "secret" / "x", 5)
    with pytest.raises(MediaError, match="no such file"):
        read_file(tree / "ds" / "gone", 100)
    with pytest.raises(MediaError) as e:  # a symlink swapped in after the check is not followed
        read_file(tree / "ds" / "out.bin", 100)
    assert CANARY not in str(e.value)


class _Files(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/img"):
            body = b"x" * 64
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/to-file":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            body = f"not found, {CANARY}".encode()
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_urls_are_fetched_within_bounds_naming_the_status_never_the_body(http_url):
    assert fetch_url(http_url + "/img.png", 100) == b"x" * 64
    with pytest.raises(MediaError, match="over the 10 bytes"):
        fetch_url(http_url + "/img.png", 10)
    with pytest.raises(MediaError) as e:
        fetch_url(http_url + "/missing.png?token=SIGNED-SECRET", 100)
    assert "HTTP 404" in str(e.value) and CANARY not in str(e.value) and "SIGNED-SECRET" not in str(e.value)
    with pytest.raises(MediaError, match=r"HTTP 302: a redirect not followed \(only to http\(s\) URLs\)"):
        fetch_url(http_url + "/to-file", 100)
