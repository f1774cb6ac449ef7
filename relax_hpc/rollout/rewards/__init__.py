"""Rewards: built-in rule rewards, Relax-style custom reward functions, group rewards, and failure reporting.

The contract is Relax's (``--custom-rm-path``, ``--reward-key``, ``--group-rm``, ``--rm-type``):

- ``rollout.custom_rm_path: package.module.function`` names ``async def reward_func(args, sample, **kwargs)``
  returning a float, or a dict whose scalar is read through ``rollout.reward_key`` (the whole dict is kept
  in ``sample.reward``; its other numeric keys are logged as ``rollout/<key>/mean`` etc.). A plain ``def``
  works too (it runs in a worker thread). The module must be importable (on ``sys.path``/``PYTHONPATH``).
- ``rollout.group_rm: true``: ``reward_func(args, samples, **kwargs)`` gets a whole group (the
  ``n_samples_per_prompt`` samples of one prompt) and returns one float or dict per sample, in order.
- ``args`` is a namespace with Relax's flag names (``args.reward_key``, ``args.n_samples_per_prompt``,
  ``args.rollout_max_response_len``, ...; see :func:`relax_args`) plus every key of
  ``rollout.custom_config_path`` (Relax's ``--custom-config-path``). It is made for the user's function
  only: relax_hpc reads its own settings from the typed recipe.
- Without a custom function, ``rollout.rm_type`` (or ``sample.metadata["rm_type"]``, which wins) picks a
  built-in: ``math``, ``exact_match``, ``f1``, ``dummy``, and Relax's ``dapo``, ``deepscaler``,
  ``multiple_choice``, ``gpqa``, ``random``, ``remote_rm``, ``dapo-genrm`` (the run's judge, ``roles.genrm``;
  :mod:`relax_hpc.rollout.genrm`) (:mod:`relax_hpc.rollout.rewards.builtin`);
  ``boxed_<type>`` first extracts the last ``\\boxed{...}`` of the response.

A reward that raises, runs longer than ``rollout.reward_timeout_s``, or returns something that is not a
finite number (None, NaN, a string such as "0.5", a bool) or has no ``reward_key`` is a
:class:`RewardFailure`. Finite means finite where the reward is stored: the exchange's ``raw_reward`` column
is float32 (:mod:`relax_hpc.exchange.fields`), so 1e39, finite as a Python float, is refused (it would be
stored as inf and make every advantage, the loss and then the weights NaN). A reward a custom generate
function set on its sample is checked the same way. A failure holds the sample's index, group, prompt,
response and label with the exception and its traceback. ``rollout.reward_error_policy`` decides what follows:
``fail`` raises :class:`RewardError` with the report (the run stops), ``skip`` logs it, sets the sample's reward
to 0.0 and status FAILED (its error in ``metadata["reward_error"]``) and the run goes on.

The package: :mod:`~relax_hpc.rollout.rewards.runner` (the runner, custom functions, failures),
:mod:`~relax_hpc.rollout.rewards.builtin` (the built-in rules and their table),
:mod:`~relax_hpc.rollout.rewards.answers` (answer extraction and comparison: a leaf). Imports run one way:
runner → builtin → answers. GenRM, the judge client a reward calls, is :mod:`relax_hpc.rollout.genrm`.

No torch here.
"""

from relax_hpc.rollout.rewards.answers import extract_answer, extract_boxed, math_equal, normalize_answer
from relax_hpc.rollout.rewards.builtin import (AWAITED_REWARDS, BUILTIN_REWARDS, builtin_reward, dapo_genrm_reward,
                                               exact_match_reward, math_reward)
from relax_hpc.rollout.rewards.runner import (GENERATE_PARAMS, REWARD_PARAMS, RewardError, RewardFailure, RewardRunner,
                                              RewardTimeout, load_custom_config, load_function, positive_seconds,
                                              relax_args)

# the names a user's reward function imports (the built-in rules and answer checks it builds on) stay where they
# were before the package was split: relax_hpc.rollout.rewards
__all__ = ["AWAITED_REWARDS", "BUILTIN_REWARDS", "GENERATE_PARAMS", "REWARD_PARAMS", "RewardError", "RewardFailure",
           "RewardRunner", "RewardTimeout", "builtin_reward", "dapo_genrm_reward", "exact_match_reward",
           "extract_answer", "extract_boxed", "load_custom_config", "load_function", "math_equal", "math_reward",
           "normalize_answer", "positive_seconds", "relax_args"]
