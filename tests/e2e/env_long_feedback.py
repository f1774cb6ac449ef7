"""The multi-turn quickstart's environment with feedback a user would write: a sentence, not " no=".

Relax's ``BaseInteractionEnv`` form, no relax_hpc import (as ``recipes/examples/env_arith.py``). The sentence is
58 tokens of the quickstart's character-level vocabulary: a wrong first answer makes prompt (4) + answer (1) +
feedback (58) + answer (1) = 64 tokens, four times the quickstart's ``train.max_seq_len`` of 16. The rollout must
bound the sample by that (tests/e2e/test_multiturn.py, tests/rollout/test_multiturn.py).
"""

FEEDBACK = " no, that is not the sum of the two digits; try once more="


class LongFeedbackEnv:
    def __init__(self, *, label: str, max_turns: int):
        self.label, self.max_turns, self.turn = label, max_turns, 0

    def reset(self):
        self.turn = 0
        return {"obs_str": "", "role": "user"}, {}

    def step(self, response_text: str):
        self.turn += 1
        correct = response_text[:1] == self.label
        done = correct or self.turn >= self.max_turns
        return {"obs_str": "" if done else FEEDBACK, "role": "user"}, done, {"correct": correct}

    def close(self):
        pass

    def format_observation(self, observation: dict) -> dict:
        return {"role": observation.get("role", "user"), "content": observation["obs_str"]}


def build_env(sample=None, args=None, **_):
    max_turns = getattr(args, "max_turns", None) or 2
    return LongFeedbackEnv(label=str(sample.label).strip(), max_turns=max_turns)
