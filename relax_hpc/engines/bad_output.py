"""The CPU engine's test hook ``RELAX_TEST_ENGINE_BAD_OUTPUT=KIND:N[:CLAIM]``: spoils the engine's first ``N``
generate answers that have something to spoil, one way (:data:`BAD_OUTPUTS`). See
:mod:`relax_hpc.engines.cpu_engine` for the kinds. A scoring answer (no output, ``input_token_logprobs``) has
something to spoil for ``nan_logprobs`` and ``positive_logprobs``: its first input log-prob (row 1; row 0 is
SGLang's null pad)."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("relax_hpc.cpu_engine")

BAD_OUTPUT_ENV = "RELAX_TEST_ENGINE_BAD_OUTPUT"
BAD_OUTPUTS = ("nan_logprobs", "positive_logprobs", "no_logprobs", "token_past_vocab", "empty_output", "wrong_count")


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
                            or (not rows and self.kind.endswith("logprobs"))):
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
        else:  # wrong_count
            meta["completion_tokens"] += 1

