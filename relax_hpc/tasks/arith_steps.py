"""The multi-turn arithmetic (``recipes/quickstart-multiturn.yaml``) with Relax's five-value environment step.

The environment of ``recipes/examples/env_arith.py`` written as Relax's homepage (and gymnasium) has it:
``step(response_text) -> (obs, reward, terminated, truncated, info)``. The reward of each step is what that turn
earns: a right answer ends the episode (``terminated``) with the quickstart's partial credit
(:func:`~relax_hpc.tasks.arith.shaped_score`), halved on the second turn; a wrong answer before the last turn
earns 0 and gets the observation " no="; the last turn ends it either way (``truncated`` when wrong: the env's own
turn limit). The reward function (:func:`step_reward_sum`) reads nothing but the per-step rewards the loop kept in
``metadata["step_rewards"]``, and their sum is exactly :func:`~relax_hpc.tasks.arith.multiturn_reward`.

    relax-submit --local recipes/quickstart-multiturn.yaml \\
        rollout.interaction_env_path=relax_hpc.tasks.arith_steps \\
        rollout.custom_rm_path=relax_hpc.tasks.arith_steps.step_reward_sum
"""

from __future__ import annotations

from typing import Any

from relax_hpc.tasks.arith import shaped_score


class ArithStepsEnv:
    """Relax's interaction env with the five-value ``step``."""

    def __init__(self, *, label: str, max_turns: int):
        self.label, self.max_turns, self.turn = label, max_turns, 0

    def reset(self):
        self.turn = 0
        return {"obs_str": "", "role": "user"}, {}

    def step(self, response_text: str):
        self.turn += 1
        correct = response_text[:1] == self.label
        last = self.turn >= self.max_turns
        done = correct or last
        reward = (shaped_score(response_text, self.label) * (0.5 if self.turn > 1 else 1.0)) if done else 0.0
        obs = {"obs_str": "" if done else " no=", "role": "user"}
        return obs, reward, correct, last and not correct, {"correct": correct, "turn": self.turn}

    def close(self):
        pass

    def format_observation(self, observation: dict) -> dict:
        return {"role": observation.get("role", "user"), "content": observation["obs_str"]}


def build_env(sample=None, args=None, **_):
    """Relax's factory: the env of ``sample`` (its label), with ``args.max_turns`` turns (default 2)."""
    return ArithStepsEnv(label=str(sample.label).strip(), max_turns=getattr(args, "max_turns", None) or 2)


async def step_reward_sum(args: Any, sample: Any, **kwargs: Any) -> float:
    """The sample's reward: the sum of its per-step rewards (0 for a rollout whose env never stepped)."""
    return float(sum(sample.metadata.get("step_rewards") or ()))
