"""Key files of engines the run does not own (``relax-scale --attach-url URL --key-file FILE``,
``rollout.external_engines``): the key is read from a file readable by its owner alone, never taken from a
command line (``ps`` shows those to every user of the node) or from the recipe."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from urllib.parse import urlsplit


class KeyFileError(ValueError):
    """A key file that cannot be used: absent, not a file, empty, or readable by others."""


def read_key_file(path: str | os.PathLike, what: str = "--key-file") -> str:
    """The key in ``path`` (stripped). Refused unless it is a regular file of mode 0600 or 0400 (no group or other
    bits): a key others can read is a key others can use to generate with, or overwrite the weights of, the
    engine."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except OSError as e:
        raise KeyFileError(f"{what} {p}: cannot be read ({e.strerror or e}). Fix: give the file that holds the "
                           "engine's API key") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{what} {p}: not a regular file. Fix: give the file that holds the engine's API key")
    if st.st_mode & 0o077:
        raise KeyFileError(f"{what} {p}: mode {stat.S_IMODE(st.st_mode):04o}, readable by others than its owner; an "
                           f"engine key must be private. Fix: chmod 600 {p}")
    try:
        key = p.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"{what} {p}: cannot be read ({e})") from None
    if not key or "\n" in key:
        raise KeyFileError(f"{what} {p}: {'empty' if not key else 'more than one line'}; it must hold the key alone, "
                           "on one line")
    return key


def check_url(url: str) -> str:
    """An external engine's URL as registered (no trailing slash); ValueError naming what is wrong."""
    parts = urlsplit(str(url))
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"engine URL {url!r}: expected http://HOST:PORT (or https://)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"engine URL {url!r}: expected http://HOST:PORT with no path")
    return str(url).rstrip("/")
