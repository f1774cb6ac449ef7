"""relax-scale's work: ask a running run's controller for a different number of rollout engines, or to take in
(``--attach-url URL --key-file FILE``) or drain (``--drain URL``) an engine it does not own.

The controller decides (it owns the engine registry; :mod:`relax_hpc.controller.elastic`); this only parses the
request, sends it over the run's control socket with the run's token, and, with ``wait``, follows the operation in
``state.json`` until it is done.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from relax_hpc.controller.protocol import Client, ProtocolError
from relax_hpc.launch.attach import AttachOptions
from relax_hpc.rundir import RunDir

SPEC = re.compile(r"^rollout=([+\-=]?)(\d+)$")


class ScaleError(RuntimeError):
    pass


def parse_spec(spec: str) -> str:
    """``rollout=+N`` / ``rollout=-N`` / ``rollout=N`` (or ``=N``) → ``+N`` / ``-N`` / ``=N``."""
    m = SPEC.match(spec.replace(" ", ""))
    if not m:
        raise ScaleError(f"{spec!r}: expected rollout=+N (add N engines), rollout=-N (drain N) or rollout=N "
                         "(exactly N engines)")
    return f"{m.group(1) or '='}{m.group(2)}"


def scale(rd: RunDir, target: str | None, attach: dict[str, Any] | None = None, cancel: str | None = None,
          wait_s: float = 0.0, *, attach_url: str | None = None, key_file: str | None = None,
          drain_url: str | None = None) -> dict:
    """Send the request; the controller's answer (``accepted``, ``op``, ``message``), and with ``wait_s`` the
    operation as ``state.json`` shows it when it ended (or when the wait ran out).

    ``attach_url`` with ``key_file``: a running engine the run does not own joins it (``relax-scale --attach-url``);
    ``drain_url``: such an engine is drained (``--drain``), and keeps running. The key file is checked here (mode
    0600) and sent as an absolute path: the controller reads the key itself, the key never travels."""
    if attach is not None:
        try:
            AttachOptions.from_dict(attach)
        except ValueError as e:
            raise ScaleError(str(e)) from None
    extra: dict[str, Any] = {}
    if attach_url is not None or drain_url is not None:
        from relax_hpc.engines.keys import KeyFileError, check_url, read_key_file

        try:
            if attach_url is not None:
                if not key_file:
                    raise ScaleError(f"--attach-url {attach_url} needs --key-file FILE: the file holding the engine's "
                                     "API key (mode 0600); a key is never given on the command line")
                read_key_file(key_file)
                extra["external"] = {"url": check_url(attach_url),
                                     "key_file": str(Path(key_file).expanduser().resolve())}
            else:
                extra["drain_url"] = check_url(drain_url)
        except (ValueError, KeyFileError) as e:
            raise ScaleError(str(e)) from None
    addr = rd.read_json(rd.controller_addr, {}) or {}
    state = (rd.read_json(rd.state, {}) or {}).get("state")
    if not addr or state != "RUNNING":
        raise ScaleError(f"run {rd.name} has no running controller (state {state or 'unknown'}): nothing to scale")
    try:
        client = Client(addr["host"], int(addr["port"]), rd.token(), timeout_s=30.0)
        try:
            if extra:
                reply = client.request("scale", target="external", attach=None, cancel=None, by="relax-scale", **extra)
            else:
                reply = client.scale(parse_spec(target) if target else "=0", attach=attach, cancel=cancel)
        finally:
            client.close()
    except (OSError, ProtocolError) as e:
        raise ScaleError(f"cannot reach the controller of run {rd.name} at {addr['host']}:{addr['port']}: {e}") from None
    out = {"run": rd.name, **{k: reply.get(k) for k in ("accepted", "op", "message", "job_id")}}
    if reply.get("accepted") and reply.get("op") and wait_s > 0:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            doc = rd.read_json(rd.state, {}) or {}
            op = next((o for o in doc.get("scale") or [] if o.get("id") == reply["op"]), None)
            if op is not None and op.get("state") != "running" or doc.get("state") != "RUNNING":
                break
            time.sleep(0.5)
        out["operation"] = op
    return out
