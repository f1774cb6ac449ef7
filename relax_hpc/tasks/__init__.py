"""Toy tasks: prompts and reward functions small enough that a tiny model learns them in minutes on a CPU.

Each reward is written in Relax's documented form (``async def reward_func(args, sample, **kwargs)``),
so it doubles as an example of a custom reward (``rollout.custom_rm_path``).
"""
