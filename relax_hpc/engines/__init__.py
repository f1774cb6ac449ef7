"""Engines: the inference servers a run generates with, and everything that talks to them as engines.

- :mod:`~relax_hpc.engines.client`: ``EngineClient``, the one module that knows SGLang's HTTP wire format;
  :mod:`~relax_hpc.engines.picker`: the least-busy engine picker;
- :mod:`~relax_hpc.engines.launcher`: start SGLang on GPU nodes or the CPU engine elsewhere (``EngineHandle``);
- the CPU engine, ``python -m relax_hpc.engines.cpu_engine``: :mod:`~relax_hpc.engines.http` (routes, the key
  check), :mod:`~relax_hpc.engines.scheduler`, :mod:`~relax_hpc.engines.model_runner`,
  :mod:`~relax_hpc.engines.receiver` (the weight receiver, also the weight follower's); their bounded HTTP server,
  :mod:`~relax_hpc.engines.http_server`;
- :mod:`~relax_hpc.engines.router`: the local router custom generate functions call as "SGLang's router".

Kept lazy: importing ``relax_hpc.engines`` costs nothing (no torch, no httpx) until a name is used.
"""

import importlib

_LAZY = {
    "EngineClient": "client", "EngineError": "client", "FinishReason": "client", "Generation": "client",
    "SamplingParams": "client",
    "EngineHandle": "launcher", "EngineLaunchError": "launcher", "launch_engine": "launcher", "start_engine": "launcher",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
