"""Rollout: the generation side of a run, from prompts to scored samples (data, the driver, multi-turn, rewards,
dynamic sampling, eval). The engines it talks to, their client and their launcher are :mod:`relax_hpc.engines`.

Importing ``relax_hpc.rollout`` costs nothing (no torch, no httpx): each submodule is imported where it is used.
"""
