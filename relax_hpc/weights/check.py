"""The check that a weight sync landed: a spot fingerprint against every engine (and follower).

After the push (:mod:`relax_hpc.weights.push`, the actor's sync), the actor keeps the first ``rows`` rows of
every tensor it sent (cheap: rows × width each); :meth:`EngineChecker.check` picks three of them (first, middle
and last by name) and compares them with what each engine serves (``/get_weights_by_name`` with ``truncate_size =
rows``): the sha256 fingerprint of :mod:`relax_hpc.weights.fingerprint` over those slices must be equal, and
the largest absolute difference is reported. Whole-tensor fingerprints of a large model through JSON would
be slow; the tests fingerprint the tiny model whole.
"""

from __future__ import annotations

from typing import Any

import torch

ROWS = 4


def probe(named: dict[str, torch.Tensor], k: int = 3) -> list[str]:
    names = sorted(named)
    if len(names) <= k:
        return names
    return sorted({names[0], names[len(names) // 2], names[-1]})


class EngineChecker:
    """Checks engines after a sync; keeps one client per engine URL (a new HTTP client costs ~0.1 s)."""

    def __init__(self, api_key: str | None = None) -> None:
        self._clients: dict[str, Any] = {}
        self._api_key = api_key  # the run's engine key

    def client(self, url: str) -> Any:
        from relax_hpc.engines.client import EngineClient

        if url not in self._clients:
            self._clients[url] = EngineClient(url, api_key=self._api_key)
        return self._clients[url]

    def check(self, engines: dict[str, str], heads: dict[str, torch.Tensor], version: str,
              rows: int = ROWS) -> dict[str, Any]:
        """Per engine: fingerprint equal, max |engine − actor| over the probed slices, and its weight version; or
        ``{"unreachable": why}`` for an engine that no longer answers at all (it left after the push: scancel,
        preemption), which the actor then reports dead instead of failing the sync."""
        from relax_hpc.engines.client import EngineError
        from relax_hpc.weights.fingerprint import fingerprint

        names = probe(heads)
        want = {n: heads[n][:rows] for n in names}
        out: dict[str, Any] = {}
        for name, url in engines.items():
            c = self.client(url)
            try:
                got = {n: torch.tensor(c.get_weights_by_name(n, truncate_size=rows), dtype=torch.float64)
                       for n in names}
                v = c.weight_version()
            except EngineError as e:
                if e.status is not None:  # it answered, wrongly: that is a failed sync
                    raise
                out[name] = {"unreachable": str(e)}
                continue
            diff = max((float((got[n] - want[n].double().reshape(got[n].shape)).abs().max()) for n in names),
                       default=0.0)
            out[name] = {"fingerprint_equal": fingerprint(got) == fingerprint(want), "max_abs_diff": diff,
                         "version": v, "version_ok": v == str(version)}
        return out

    def unreachable(self, engines: dict[str, str]) -> dict[str, str]:
        """The engines that do not answer ``/health`` at all (no HTTP reply: the process is gone), with why.
        An engine that died after its last generate request is found here, before a sync would fail on it."""
        from relax_hpc.engines.client import EngineError

        dead = {}
        for name, url in engines.items():
            try:
                self.client(url).request("GET", "/health", timeout=10.0, retries=1)
            except EngineError as e:
                if e.status is None:  # an HTTP error status means something answered
                    dead[name] = str(e)
        return dead

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()
