"""The calls the controller makes to engines it does not own (:mod:`relax_hpc.controller.external`), and the checks of
their URL and key file (also the validator's, for ``rollout.external_engines``).

Why here: the controller speaks to no engine itself (its arrows stop at ``rollout``); these are rollout's calls,
through the one engine client. Nothing here imports httpx or torch until a call is made: the validator runs on a
login node.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

from relax_hpc.engines.keys import KeyFileError, check_url, read_key_file
from relax_hpc.threads import daemon_call

__all__ = ["KeyFileError", "ExternalEngineError", "check_url", "read_key_file", "probe", "load_from_disk", "health",
           "in_thread"]

PROBE_TIMEOUT_S = 10.0  # the join's /model_info
LOAD_TIMEOUT_S = 1800.0  # one /update_weights_from_disk
HEALTH_TIMEOUT_S = 10.0


class ExternalEngineError(RuntimeError):
    """An external engine refused or did not answer; ``str(e)`` says which, and the fix."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


def probe(url: str, key_file: str) -> dict:
    """``/model_info`` of the engine at ``url`` with the key in ``key_file`` (its weight version, model path)."""
    from relax_hpc.engines.client import EngineClient, EngineError

    client = EngineClient(url, api_key=read_key_file(key_file), timeout=PROBE_TIMEOUT_S, connect_timeout=5.0,
                          retries=0)
    try:
        return client.model_info()
    except EngineError as e:
        if e.status in (401, 403):
            raise ExternalEngineError(f"the engine at {url} refused the key in {key_file} (HTTP {e.status}). Fix: "
                                      "give the key file the engine was started with (the reference engine's "
                                      "--api-key-file, SGLang's --api-key)", status=e.status) from None
        raise ExternalEngineError(f"the engine at {url} did not answer /model_info: {e.cause}. Fix: start it, or "
                                  "give a URL this run's controller can reach", status=e.status) from None
    finally:
        client.close()


def load_from_disk(url: str, key_file: str, path: str, version: str) -> str | None:
    """``/update_weights_from_disk`` of the HF directory ``path`` tagged ``version`` (SGLang's call and the reference
    engine's); the weight version the engine reports after it. EngineError if the load failed."""
    from relax_hpc.engines.client import EngineClient

    client = EngineClient(url, api_key=read_key_file(key_file), timeout=LOAD_TIMEOUT_S, retries=0)
    try:
        client.update_weights_from_disk(path, weight_version=version, timeout=LOAD_TIMEOUT_S)
        return client.weight_version()
    finally:
        client.close()


def health(url: str) -> None:
    """``GET /health`` (open without a key on SGLang and the reference engine). Raises
    :class:`ExternalEngineError` with ``status`` None if the engine did not answer at all; an HTTP error (a busy
    engine's 503) carries its status."""
    from relax_hpc.engines.client import EngineClient, EngineError

    client = EngineClient(url, timeout=HEALTH_TIMEOUT_S, connect_timeout=5.0, retries=0)
    try:
        client.request("GET", "/health", timeout=HEALTH_TIMEOUT_S, retries=0)
    except EngineError as e:
        raise ExternalEngineError(e.cause, status=e.status) from None
    finally:
        client.close()


def in_thread(fn: Callable[..., Any], *args: Any, name: str) -> Future:
    """``fn(*args)`` in a daemon thread of its own: the controller's loop never waits for an engine."""
    return daemon_call(fn, *args, thread_name=name)
