"""The CPU engine's test hook ``RELAX_TEST_ENGINE_BAD_OUTPUT=KIND:N[:CLAIM]``: spoils the engine's first ``N``
generate answers that have something to spoil, one way (:data:`BAD_OUTPUTS`). See
:mod:`relax_hpc.engines.cpu_engine` for the kinds. A scoring answer (no output, ``input_token_logprobs``) has
something to spoil for ``nan_logprobs`` and ``positive_logprobs``: its first input log-prob (row 1; row 0 is
SGLang's null pad). The routing replay kinds spoil an answer's ``meta_info.routed_experts`` (only answers that
carry them, i.e. asked with ``return_routed_experts``): ``expert_out_of_range`` sets the first token's first id to
:data:`PAST_ANY_EXPERT`, ``duplicate_expert`` gives the first token's first layer its first id twice (top-k >= 2),
``extra_layer`` sends each token's row twice (as many ids as twice the layers)."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("relax_hpc.cpu_engine")

BAD_OUTPUT_ENV = "RELAX_TEST_ENGINE_BAD_OUTPUT"
BAD_OUTPUTS = ("nan_logprobs", "positive_logprobs", "no_logprobs", "token_past_vocab", "empty_output", "wrong_count",
               "expert_out_of_range", "duplicate_expert", "extra_layer")
ROUTED_OUTPUTS = ("expert_out_of_range", "duplicate_expert", "extra_layer")  # spoil meta_info.routed_experts
PAST_ANY_EXPERT = 1 << 20  # an expert id no model has (Qwen3-30B-A3B has 128 experts, DeepSeek-V3 256)


class BadOutput:
    """The ``RELAX_TEST_ENGINE_BAD_OUTPUT`` hook (module docstring): spoils the first ``n`` answers it can."""

    def __init__(self, spec: str, vocab_size: int):
        kind, _, rest = spec.partition(":")
        n, _, claim = rest.partition(":")
        if kind not in BAD_OUTPUTS or not n.isdigit():
            raise ValueError(f"{BAD_OUTPUT_ENV}={spec!r}: expected KIND:N[:CLAIM_FILE], KIND one of "
                             f"{', '.join(BAD_OUTPUTS)}")
        self.kind, self.left, self.vocab_size = kind, int(n), vocab_size
        self.lock = threading.Lock()
        if claim:
            try:
                os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                self.left = 0  # another engine of the run claimed it
        if self.left:
            log.warning("%s=%s: the next %d generate answers will be %s", BAD_OUTPUT_ENV, spec, self.left, kind)

    def spoil(self, out: dict) -> None:
        meta = out["meta_info"]
        rows = meta.get("output_token_logprobs")
        inputs = meta.get("input_token_logprobs")
        scoring = not out["output_ids"] and inputs is not None and len(inputs) > 1 \
            and self.kind in ("nan_logprobs", "positive_logprobs")
        if not scoring and (not out["output_ids"] or (meta["finish_reason"] or {}).get("type") == "abort"
                            or (not rows and self.kind.endswith("logprobs"))
                            or (self.kind in ROUTED_OUTPUTS and not meta.get("routed_experts"))):
            return  # nothing of that kind to spoil here: the next answer
        with self.lock:
            if self.left <= 0:
                return
            self.left -= 1
        if scoring:
            inputs[1][0] = float("nan") if self.kind == "nan_logprobs" else 0.5
        elif self.kind in ("nan_logprobs", "positive_logprobs"):
            rows[0][0] = float("nan") if self.kind == "nan_logprobs" else 0.5  # json.dumps writes NaN
        elif self.kind == "no_logprobs":
            del meta["output_token_logprobs"]
        elif self.kind == "token_past_vocab":
            out["output_ids"][0] = self.vocab_size
            if rows:
                rows[0][1] = self.vocab_size
        elif self.kind == "empty_output":
            out["output_ids"], meta["completion_tokens"], out["text"] = [], 0, ""
            if rows is not None:
                meta["output_token_logprobs"] = []
        elif self.kind in ROUTED_OUTPUTS:
            meta["routed_experts"] = _spoil_routed(meta, self.kind)
        else:  # wrong_count
            meta["completion_tokens"] += 1


def _spoil_routed(meta: dict, kind: str) -> str:
    """``meta["routed_experts"]`` (SGLang's base64 of int32 ``[prompt + completion - 1, layers, top_k]``) spoiled
    the ``kind`` way (module docstring)."""
    import base64

    import numpy as np

    ids = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").copy()
    if kind == "expert_out_of_range":
        ids[0] = PAST_ANY_EXPERT
    elif kind == "duplicate_expert":
        ids[1] = ids[0]  # the first token's first layer (ids[0..k-1]) with top-k >= 2
    else:  # extra_layer: each token's row twice
        rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
        ids = np.concatenate([ids.reshape(rows, -1)] * 2, axis=1)
    return base64.b64encode(ids.astype("<i4").tobytes()).decode()
