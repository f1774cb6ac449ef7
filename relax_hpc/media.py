"""The files a data row names (images now; audio and video will read theirs through the same door): where they may
be read from, and how. A public dataset is untrusted input: a row must not decide which files of the node the run
reads, nor get their contents into a message (sample errors reach logs, metrics and W&B).

**Where.** :class:`MediaPolicy` says it: a relative path is read from the dataset's own directory (the data
file's, ``base_dir``); a path, relative or absolute, is read only when its real location (symlinks resolved) lies
under that directory or under one of the recipe's ``data.media_roots``. Anything else (``../secret``,
``/etc/shadow``, a symlink pointing out) is refused naming the path; whether such a file exists is not looked at,
so the message says nothing of the node's files either. ``data:`` URLs and base64 are data, not files: always
taken. ``http(s)://`` URLs are fetched only when the recipe allows (``data.allow_media_urls``); other schemes never.

A trusted caller (the engine's keyed requests, a multi-turn environment's observations, the trainer reading the
base64 the rollout wrote) uses :data:`TRUSTED`: paths anywhere, as SGLang reads them, no URLs.

**How.** :func:`read_file` opens the resolved path without following a last symlink, refuses what is not a regular
file (a FIFO would block) and reads at most ``max_bytes``; :func:`fetch_url` reads at most ``max_bytes`` within a
deadline, following redirects to http(s) only. Errors are :class:`MediaError`: a path, a size, a status; never a
byte of what was read.

A leaf: the standard library only.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

URL_TIMEOUT_S = 30.0  # one URL fetch, connect to last byte
PATH_MAX = 4096  # a longer string is not taken for a path (a base64 payload, say)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]{0,31})://")


class MediaError(ValueError):
    """A file or URL a row names that cannot be read; the message is the reason (the caller adds where)."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where a row's media may come from. ``base_dir``: the dataset's own directory (relative paths start there);
    ``roots``: more directories (``data.media_roots``); ``allow_urls``: fetch http(s) URLs
    (``data.allow_media_urls``); ``confined``: False for a trusted caller (paths anywhere)."""

    base_dir: Path | None = None
    roots: tuple[Path, ...] = ()
    allow_urls: bool = False
    confined: bool = True
    _real: tuple[Path, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dirs = ([self.base_dir] if self.base_dir is not None else []) + list(self.roots)
        object.__setattr__(self, "_real", tuple(Path(os.path.realpath(d)) for d in dirs))

    def where(self) -> str:
        """The places files may come from, for a message."""
        base = f"the dataset's directory {self.base_dir}" if self.base_dir is not None else "no dataset directory"
        roots = ", ".join(map(str, self.roots)) if self.roots else "none"
        return f"{base} and data.media_roots ({roots})"

    def inside(self, path: Path) -> Path | None:
        """``path``'s real location (symlinks resolved) when it lies under an allowed directory, else None."""
        real = Path(os.path.realpath(path))
        return real if any(real == d or real.is_relative_to(d) for d in self._real) else None


TRUSTED = MediaPolicy(confined=False)


def data_roots(roots: Iterable[str | os.PathLike]) -> tuple[Path, ...]:
    """``data.media_roots`` as :class:`MediaPolicy` takes them: absolute, ``~`` expanded (relative to the working
    directory, the submit directory the roles run in)."""
    return tuple(Path(os.path.abspath(Path(r).expanduser())) for r in roots)


def as_policy(where: MediaPolicy | str | os.PathLike | None) -> MediaPolicy:
    """A policy from what callers pass: a policy as it is, a directory (confined to it), None (:data:`TRUSTED`)."""
    if isinstance(where, MediaPolicy):
        return where
    return TRUSTED if where is None else MediaPolicy(base_dir=Path(where))


def url_scheme(ref: str) -> str | None:
    """The scheme of ``ref`` when it is a URL with ``://`` (lower case), else None (base64 never has a colon)."""
    m = _SCHEME.match(ref)
    return m.group(1).lower() if m else None


def may_be_path(ref: str) -> bool:
    """Whether a string can name a file at all (short, one line, no NUL)."""
    return 0 < len(ref) < PATH_MAX and "\n" not in ref and "\0" not in ref


def resolve(ref: str, policy: MediaPolicy) -> Path:
    """The path a row's string names (relative to ``policy.base_dir``), its real location when ``policy`` is
    confined; :class:`MediaError` naming the path when it lies outside the allowed directories."""
    path = Path(ref).expanduser()
    if not path.is_absolute() and policy.base_dir is not None:
        path = Path(policy.base_dir) / path
    if not policy.confined:
        return path
    real = policy.inside(path)
    if real is None:
        # the joined path, never its real one: a symlink's target or $HOME would tell the row about the node
        shown = f"{ref!r}" if str(path) == ref else f"{ref!r} ({os.path.normpath(path)})"
        raise MediaError(f"{shown} is outside {policy.where()}: a data row may only name files there. "
                         "Fix: move the file under the dataset's directory, or add its directory to data.media_roots")
    return real


def read_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file, at most ``max_bytes``; :class:`MediaError` naming the path otherwise. The last
    component is not followed if it is a symlink (swapped in after :func:`resolve` checked it), and the file is
    opened non-blocking so that a FIFO is refused rather than waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise MediaError(f"no such file {str(path)!r}") from None
    except OSError as e:
        raise MediaError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaError(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise MediaError(f"{path}: {st.st_size} bytes, over the {max_bytes} bytes a media file may have")
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise MediaError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if len(data) > max_bytes:  # grew since the stat
        raise MediaError(f"{path}: over the {max_bytes} bytes a media file may have")
    return data


def fetch_url(url: str, max_bytes: int, timeout: float = URL_TIMEOUT_S) -> bytes:
    """The body of an http(s) URL, at most ``max_bytes``; redirects only to http(s). :class:`MediaError` with the
    URL and the status or the transport error, never the body."""
    import urllib.error
    import urllib.request

    class Redirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            if url_scheme(newurl) not in ("http", "https"):
                raise MediaError(f"{shown}: redirected to a {url_scheme(newurl) or 'relative'} URL; only http(s) "
                                 "is followed")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    shown = short_url(url)
    opener = urllib.request.OpenerDirector()
    for h in (urllib.request.ProxyHandler(), urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(),
              Redirects(), urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor()):
        opener.add_handler(h)
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "relax_hpc"}), timeout=timeout) as r:
            length = r.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise MediaError(f"{shown}: {length} bytes, over the {max_bytes} bytes a media file may have")
            data = r.read(max_bytes + 1)
    except MediaError:
        raise
    except urllib.error.HTTPError as e:  # a redirect to another scheme ends here too (urllib refuses it)
        why = ": a redirect not followed (only to http(s) URLs)" if 300 <= e.code < 400 else ""
        raise MediaError(f"{shown}: HTTP {e.code}{why}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise MediaError(f"{shown}: cannot be fetched ({type(reason).__name__}: {reason})") from None
    if len(data) > max_bytes:
        raise MediaError(f"{shown}: over the {max_bytes} bytes a media file may have")
    return data


def short_url(url: str) -> str:
    """A URL for a message: without its query and credentials (a signed URL's token), cut to 200 characters."""
    from urllib.parse import urlsplit

    try:
        p = urlsplit(url)
        host = p.hostname or ""
        if p.port:
            host += f":{p.port}"
        s = f"{p.scheme}://{host}{p.path}"
    except ValueError:
        s = url.split("?", 1)[0]
    return repr(s if len(s) <= 200 else s[:200] + "...")
