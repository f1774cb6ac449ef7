"""The quickstart's arithmetic with a second chance, as a Relax interaction environment (no relax_hpc import).

Written exactly as Relax documents it (``examples/<algo>/env_<algo>.py`` with ``build_env``): the environment
reads the model's answer; a wrong one gets the observation " no=" and one more turn. Used by
``recipes/quickstart-multiturn.yaml`` through ``rollout.interaction_env_path``.
"""


class BaseInteractionEnv:
    """Relax's ``examples/deepeyes/base_env.py`` interface, which a Relax user copies beside the env."""

    def reset(self):
        raise NotImplementedError

    def step(self, response_text: str):
        raise NotImplementedError

    def close(self):
        pass

    def format_observation(self, observation: dict) -> dict:
        return {"role": observation.get("role", "user"), "content": observation["obs_str"]}


class ArithEnv(BaseInteractionEnv):
    def __init__(self, *, label: str, max_turns: int):
        self.label = label
        self.max_turns = max_turns
        self.turn = 0

    def reset(self):
        """Return (observation, info). No arguments: the sample's data came through build_env()."""
        self.turn = 0
        return {"obs_str": "", "role": "user"}, {}

    def step(self, response_text: str):
        self.turn += 1
        correct = response_text[:1] == self.label
        done = correct or self.turn >= self.max_turns
        return {"obs_str": "" if done else " no=", "role": "user"}, done, {"correct": correct, "turn": self.turn}


def build_env(sample=None, args=None, **_):
    """Factory function, required by Relax rollout."""
    max_turns = args.max_turns if args is not None and getattr(args, "max_turns", None) else 2
    return ArithEnv(label=str(sample.label).strip(), max_turns=max_turns)
