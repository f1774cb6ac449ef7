"""``Sample``: one prompt's one response, as it moves from the dataset through generation and reward to training.

The field names are Relax's (``relax.utils.types.Sample``, itself slime's), so a Relax reward function that
reads ``sample.prompt``, ``sample.response``, ``sample.label`` or ``sample.metadata`` works unchanged, and a
custom generate function can fill ``tokens``, ``loss_mask`` and ``rollout_log_probs`` the way it does there.

- ``tokens`` is prompt + response token ids; the last ``response_length`` of them are the response.
- ``loss_mask`` and ``rollout_log_probs`` cover the response only (``response_length`` entries each).
- ``teacher_log_probs`` (on-policy distillation, ``opd:``): the teacher's log-prob of each response token
  (``response_length`` entries), set by the rollout role after the reward (:mod:`relax_hpc.rollout.teacher`).
- ``routed_experts`` (MoE routing replay, ``train.routing_replay``; slime/Relax's ``rollout_routed_experts``): the
  expert ids the engine routed each token it ran to, SGLang's ``meta_info["routed_experts"]`` of the latest answer
  as a compact numpy array ``[tokens, layers × top_k]`` (:func:`relax_hpc.engines.client.decode_routed_experts`;
  a custom generate function may set a flat list). Tokens the engine never ran (an observation appended after the
  last call) have none: the rollout role gives them -1 rows (no recorded routing) before the chunk is written.
- ``reward`` is what the reward function returned: a float, or a dict read through ``reward_key``
  (:meth:`Sample.get_reward_value`).
- ``weight_versions``: one entry per engine call that produced part of the response (Relax appends
  SGLang's ``meta_info["weight_version"]``); :attr:`Sample.weight_version` is the latest.
- ``status``: PENDING until generated; COMPLETED (stop), TRUNCATED (length), ABORTED (abort), FAILED
  (a reward or custom step that raised; the error is in ``metadata["reward_error"]``).

Pure Python (no torch, no numpy) so any role and the login-node tools can import it.
"""

from __future__ import annotations

import copy
import hashlib
import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SampleStatus(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"  # recoverable per-sample failure (a reward that raised, a tool error); the run may go on


# SGLang ``meta_info["finish_reason"]["type"]`` → status (Relax's mapping).
FINISH_REASON_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


@dataclass
class Sample:
    """One generated sample. Relax's names; see the module docstring for the invariants."""

    Status = SampleStatus  # Relax spells it ``Sample.Status.COMPLETED``

    group_index: int | None = None  # which prompt group (n_samples_per_prompt samples share it)
    index: int | None = None  # unique sample id within the run
    rollout_id: int | None = None  # a segment's rollout: the index of the sample it came from (None: its own)
    # prompt
    prompt: str | list[dict[str, Any]] = ""  # the text sent to the engine (chat template applied), or messages
    tokens: list[int] = field(default_factory=list)  # prompt ids, then prompt + response ids once generated
    rollout_tokens: list[int] = field(default_factory=list)  # Relax field; unused by the default generate path
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    # response
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    custom_advantage: float | list[float] | None = None
    loss_mask: list[int] | None = None  # over the response tokens; None = all ones
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None  # engine log-probs of the response tokens
    teacher_log_probs: list[float] | None = None  # OPD: the teacher's log-probs of the response tokens
    routed_experts: Any = None  # MoE routing replay: the engine's expert ids, numpy [tokens it ran, layers × top_k]
    remove_sample: bool = False  # keep for normalization but zero its loss mask
    abort_count: int = 0
    status: SampleStatus = SampleStatus.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    # --- derived -----------------------------------------------------------------------------------
    @property
    def weight_version(self) -> str | None:
        """The weight version of the latest engine call that produced this sample (None before any)."""
        return self.weight_versions[-1] if self.weight_versions else None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def effective_response_length(self) -> int:
        """Tokens that count in the loss: sum of the loss mask, else the response length (Relax's rule)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def get_reward_value(self, args: Any = None, reward_key: str | None = None) -> float:
        """The scalar reward: ``reward[reward_key]`` when the reward is a dict, else the reward itself.

        ``reward_key`` comes from the argument, else from ``args.reward_key`` (Relax's signature is
        ``get_reward_value(args)``). A float reward is returned as is even when a key is set, so a sample
        whose reward function failed (reward 0.0) reads the same under any key.
        """
        key = reward_key if reward_key is not None else getattr(args, "reward_key", None)
        return reward_value(self.reward, key)

    # --- engine output -----------------------------------------------------------------------------
    def append_response(
        self,
        token_ids: list[int],
        text: str,
        log_probs: list[float] | None = None,
        *,
        loss_mask_value: int = 1,
    ) -> None:
        """Append generated tokens (and their log-probs) to ``tokens``/``response``/masks."""
        token_ids = [int(t) for t in token_ids]
        if log_probs is not None and len(log_probs) != len(token_ids):
            raise ValueError(f"{len(log_probs)} log-probs for {len(token_ids)} tokens")
        self.tokens = list(self.tokens) + token_ids
        self.response = (self.response or "") + (text or "")
        self.response_length += len(token_ids)
        self.loss_mask = (self.loss_mask or []) + [loss_mask_value] * len(token_ids)
        if log_probs is not None:
            self.rollout_log_probs = (self.rollout_log_probs or []) + [float(x) for x in log_probs]

    def update_from_meta_info(self, meta_info: dict[str, Any]) -> None:
        """Status from ``finish_reason`` and the weight version, as Relax reads SGLang's ``meta_info``; its
        ``routed_experts`` (base64 int32, every token the engine ran: the whole sequence so far but the last token,
        so the latest answer replaces an earlier one) as ``routed_experts``: numpy ``[tokens it ran, layers ×
        top_k]`` (:func:`relax_hpc.engines.client.decode_routed_experts`)."""
        if meta_info.get("weight_version") is not None:
            self.weight_versions.append(str(meta_info["weight_version"]))
        if meta_info.get("routed_experts") is not None:  # a compact numpy array [tokens ran, layers × top_k]
            from relax_hpc.engines.client import decode_routed_experts

            ran = meta_info.get("prompt_tokens"), meta_info.get("completion_tokens")
            n = sum(ran) - 1 if all(isinstance(x, int) for x in ran) else len(self.tokens) - 1
            self.routed_experts = decode_routed_experts(meta_info["routed_experts"], n)
        reason = meta_info.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind in FINISH_REASON_STATUS:
            self.status = FINISH_REASON_STATUS[kind]

    def reset_response(self, prompt_tokens: list[int]) -> None:
        """Forget a (partial) response: back to the prompt, for a retry on another engine."""
        self.tokens = list(prompt_tokens)
        self.response = ""
        self.response_length = 0
        self.loss_mask = None
        self.rollout_log_probs = None
        self.teacher_log_probs = None
        self.routed_experts = None
        self.weight_versions = []
        self.status = SampleStatus.PENDING

    # --- copies and serialization ------------------------------------------------------------------
    def copy(self, **changes: Any) -> Sample:
        """A copy whose lists and dicts are not shared with this one (group members must not alias)."""
        new = copy.deepcopy(self)
        for k, v in changes.items():
            setattr(new, k, v)
        return new

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (status as its string value); extra attributes set on the instance are kept."""
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if hasattr(out["routed_experts"], "tolist"):  # numpy (decode_routed_experts): JSON lists
            out["routed_experts"] = out["routed_experts"].tolist()
        out["status"] = self.status.value
        for k, v in self.__dict__.items():
            if k not in out:
                out[k] = copy.deepcopy(v)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        data = dict(data)
        names = {f.name for f in dataclasses.fields(cls)}
        if "status" in data:
            data["status"] = SampleStatus(data["status"])
        sample = cls(**{k: v for k, v in data.items() if k in names})
        for k, v in data.items():
            if k not in names:
                setattr(sample, k, v)
        return sample


def reward_value(reward: Any, reward_key: str | None) -> float:
    """Scalar from a reward as a reward function returns it (float, or dict read through ``reward_key``)."""
    if reward is None:
        raise ValueError("the sample has no reward yet")
    if isinstance(reward, dict):
        if not reward_key:
            raise ValueError(
                f"the reward is a dict (keys {sorted(reward)}) but no reward_key is set. "
                "Fix: set rollout.reward_key to the key that holds the scalar reward, e.g. 'score'"
            )
        if reward_key not in reward:
            raise KeyError(f"the reward dict has no key {reward_key!r} (rollout.reward_key); keys: {sorted(reward)}")
        reward = reward[reward_key]
    if isinstance(reward, bool):
        return float(reward)
    if isinstance(reward, (int, float)):
        return float(reward)
    try:  # numpy / torch scalars
        return float(reward)
    except (TypeError, ValueError):
        raise TypeError(f"the reward must be a number, got {type(reward).__name__}: {reward!r}") from None


def sample_seed(seed: int, k: int) -> int:
    """A 63-bit request seed for sample ``k`` of a batch seeded ``seed`` (a hash, so nearby seeds differ)."""
    h = hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1
