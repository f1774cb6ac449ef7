"""Rollout: inference engines (SGLang on GPUs, relax_hpc's CPU engine elsewhere), the SGLang client, and the
generation side of a run (data, rewards, driver).

Kept lazy: importing ``relax_hpc.rollout`` costs nothing (no torch, no httpx) until a name is used, so a
submodule such as ``relax_hpc.rollout.cpu_engine`` or a light tool can import without the rest.
"""

import importlib

_LAZY = {
    "EngineClient": "client", "EngineError": "client", "FinishReason": "client", "Generation": "client",
    "SamplingParams": "client",
    "EngineHandle": "engines", "EngineLaunchError": "engines", "launch_engine": "engines", "start_engine": "engines",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
