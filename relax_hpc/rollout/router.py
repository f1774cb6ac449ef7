"""Where a custom generate function reaches the engines: ``post`` and ``router_headers``, Relax's ``http_utils.post``.

They live in :mod:`relax_hpc.engines.router` with the router; this name is the one docs/agentic.md gives users
(and the one earlier releases had), so a function ported from Relax keeps one import.
"""

from relax_hpc.engines.router import post, router_headers

__all__ = ["post", "router_headers"]
