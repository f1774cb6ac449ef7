"""The reference engine's scheduler: static batching of ``/generate`` requests over one HF model, with SGLang's
pause modes and aborts, and the sampler (top-k, top-p, per-request generators).

One scheduler thread collects waiting requests for ``batch_wait_s`` (or until ``max_batch``), left-pads them,
prefills once and decodes the whole batch with the HF KV cache; finished rows are dropped from the cache.
Requests arriving meanwhile wait for the next batch (no continuous batching). The model, its device, its lock and
the finish rule come from the engine (:class:`~relax_hpc.engines.model_runner.CPUEngine`). Inputs are built on the
CPU and moved to the model's device; the last position's logits come back to the CPU as float32, where the
sampler draws from each request's CPU generator, so sampling is the same code on the CPU and on CUDA.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from typing import Any, Protocol

import torch

from relax_hpc.engines.http import HTTPError

log = logging.getLogger("relax_hpc.cpu_engine")


class Model(Protocol):
    """What the scheduler runs (the engine): the HF model on its device under its lock, padding, the finish rule,
    the version."""

    model: Any
    device: str
    model_lock: Any
    pad_id: int
    weight_version: str

    def finish_reason(self, r: Req, tok: int) -> dict | None: ...

SAMPLING_EPS = 1e-6  # SGLang: temperature below this means greedy (temperature 1, top_k 1)


class Req:
    """One sequence in flight. The scheduler thread writes it; the HTTP thread waits on ``done``."""

    def __init__(self, rid: str, input_ids: list[int], sp: dict, return_logprob: bool, gen: torch.Generator):
        self.rid = rid
        self.input_ids = input_ids
        self.max_new_tokens: int = sp["max_new_tokens"]
        t = float(sp["temperature"])
        self.greedy = t < SAMPLING_EPS
        self.temperature = 1.0 if self.greedy else t
        self.top_k = 1 if self.greedy else int(sp["top_k"])
        self.top_p = float(sp["top_p"])
        self.stop_ids = set(sp["stop_token_ids"] or ())
        self.ignore_eos = bool(sp["ignore_eos"])
        self.stop_strs: list[str] = sp["stop"]
        self.skip_special_tokens = bool(sp["skip_special_tokens"])
        self.no_stop_trim = bool(sp["no_stop_trim"])
        self.return_logprob = return_logprob
        self.gen = gen
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: dict | None = None
        self.abort_message: str | None = None  # set by abort/pause; applied by the scheduler between steps
        self.weight_version: str | None = None
        self.error: str | None = None
        self.cached_tokens = 0  # prompt tokens served from another request's prefill (SGLang's cached_tokens)
        self.created = time.monotonic()
        self.done = threading.Event()

    def finish_with(self, reason: dict, weight_version: str) -> None:
        self.finish = reason
        self.weight_version = weight_version
        self.done.set()


# --------------------------------------------------------------------------------------------- scheduler

def left_padded(seqs: list[list[int]], pad_id: int):
    """(ids, attention mask, position ids), each ``[B, L]`` on the CPU, of sequences padded on the left: the last
    column is every row's last token, which a batch of forwards reads (generation and scoring alike)."""
    B, L = len(seqs), max(map(len, seqs))
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s)
        mask[i, L - len(s):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


class Scheduler:
    """Static batching over one HF model. Pause modes follow SGLang: ``abort`` finishes everything in flight
    as aborted, ``in_place`` parks the running batch with its KV cache, ``retract`` puts running requests
    back in the queue (their KV is dropped and recomputed, with whatever weights are loaded by then)."""

    def __init__(self, engine: Model, max_batch: int, batch_wait_s: float):
        self.engine = engine
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.cv = threading.Condition()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.paused: str | None = None
        self.parked = False
        self.refusal: str | None = None  # why new requests are refused now (the engine's memory is released)
        self.stats = {"num_batches": 0, "max_batch_size": 0, "num_requests": 0, "num_generated_tokens": 0,
                      "last_gen_throughput": 0.0}
        self.thread = threading.Thread(target=self._loop, name="cpu-engine-scheduler", daemon=True)

    # -- called from HTTP threads
    def submit(self, reqs: list[Req]) -> None:
        """Queue ``reqs``; a 400 naming the reason while the engine refuses new requests (:attr:`refusal`)."""
        with self.cv:
            if self.refusal is not None:
                raise HTTPError(400, self.refusal)
            self.waiting.extend(reqs)
            self.stats["num_requests"] += len(reqs)
            self.cv.notify_all()

    def abort(self, rid: str | None, message: str) -> int:
        """Abort one rid (or every request when rid is None). Waiting ones finish now, running ones at the next
        decode step."""
        n = 0
        with self.cv:
            for r in list(self.waiting):
                if rid is None or r.rid == rid:
                    self.waiting.remove(r)
                    r.finish_with(abort_reason(message), self.engine.weight_version)
                    n += 1
            for r in self.running:
                if (rid is None or r.rid == rid) and not r.done.is_set():
                    r.abort_message = message
                    n += 1
            self.cv.notify_all()
        return n

    def pause(self, mode: str, timeout_s: float = 120.0) -> None:
        with self.cv:
            self.paused = mode
            self.parked = False  # the scheduler must acknowledge this mode, not an earlier one
            self.cv.notify_all()
        if mode == "abort":
            self.abort(None, "Abort by pause_generation (mode=abort).")
        with self.cv:  # return once the scheduler honoured it: nothing running, or the batch parked in place
            if not self.cv.wait_for(lambda: not self.running or self.parked, timeout_s):
                raise HTTPError(500, f"scheduler did not pause within {timeout_s} s")

    def resume(self) -> None:
        with self.cv:
            self.paused = None
            self.cv.notify_all()

    def busy(self) -> tuple[int, int]:
        with self.cv:
            return len(self.running), len(self.waiting)

    # -- scheduler thread
    def _loop(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.waiting and self.paused is None)
                deadline = time.monotonic() + self.batch_wait_s  # let a burst of concurrent requests gather
                while len(self.waiting) < self.max_batch and self.paused is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.cv.wait(left)
                if self.paused is not None or not self.waiting:
                    continue
                batch = [self.waiting.popleft() for _ in range(min(self.max_batch, len(self.waiting)))]
                self.running = list(batch)
                self.stats["num_batches"] += 1
                self.stats["max_batch_size"] = max(self.stats["max_batch_size"], len(batch))
            t0, n0 = time.monotonic(), sum(len(r.output_ids) for r in batch)
            try:
                self._run(batch)
            except Exception as e:  # a bug or a bad weight: fail these requests, keep serving
                log.error("batch failed: %s", traceback.format_exc())
                for r in batch:
                    if not r.done.is_set():
                        r.error = f"{type(e).__name__}: {e}"
                        r.done.set()
            finally:
                with self.cv:
                    self.running = []
                    self.parked = False
                    n = sum(len(r.output_ids) for r in batch) - n0
                    self.stats["num_generated_tokens"] += n
                    self.stats["last_gen_throughput"] = n / max(time.monotonic() - t0, 1e-9)
                    self.cv.notify_all()

    def _control(self, rows: list[Req]) -> str:
        """Between decode steps: apply aborts and pause. Returns "go", "retract" or "done"."""
        eng = self.engine
        with self.cv:
            while True:
                for r in rows:
                    if r.abort_message is not None and not r.done.is_set():
                        r.finish_with(abort_reason(r.abort_message), eng.weight_version)
                live = [r for r in rows if not r.done.is_set()]
                if not live:
                    return "done"
                if self.paused == "in_place":
                    self.parked = True
                    self.cv.notify_all()
                    self.cv.wait()
                    continue
                self.parked = False
                if self.paused == "retract":
                    self.waiting.extendleft(reversed(live))
                    self.running = []
                    return "retract"
                return "go"

    @torch.inference_mode()
    def _run(self, batch: list[Req]) -> None:
        eng = self.engine
        rows = list(batch)
        seqs = [r.input_ids + r.output_ids for r in rows]  # output_ids is non-empty after a retract
        ids, mask, pos = left_padded(seqs, eng.pad_id)
        dev = eng.device
        ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)  # no-ops on the CPU
        with eng.model_lock:
            out = eng.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache, logits = out.past_key_values, _last_logits(out)
        pos = pos[:, -1:]
        while True:
            next_tokens, lps = sample_batch(rows, logits)
            for r, tok, lp in zip(rows, next_tokens, lps):
                r.output_ids.append(tok)
                if r.return_logprob:
                    r.logprobs.append(lp)
                reason = eng.finish_reason(r, tok)
                if reason is not None:
                    r.finish_with(reason, eng.weight_version)
            state = self._control(rows)
            if state != "go":
                return
            keep = [i for i, r in enumerate(rows) if not r.done.is_set()]
            if len(keep) < len(rows):  # drop finished rows from the batch and the KV cache
                idx = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(idx)
                mask, pos = mask[idx], pos[idx]
                rows = [rows[i] for i in keep]
                next_tokens = [next_tokens[i] for i in keep]
                with self.cv:
                    self.running = list(rows)
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long, device=dev)], dim=1)
            pos = pos + 1
            with eng.model_lock:
                out = eng.model(input_ids=torch.tensor(next_tokens, device=dev)[:, None], attention_mask=mask,
                                position_ids=pos, past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, _last_logits(out)


def _last_logits(out) -> torch.Tensor:
    """The last position's logits [B, V] on the CPU as float32 (a no-op for a float32 model on the CPU)."""
    return out.logits[:, -1, :].to("cpu", torch.float32)


def sample_batch(rows: list[Req], logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Sample one token per row (vectorized); log-probs come from the unfiltered tempered distribution.

    Top-k then top-p as SGLang applies them (on sorted, not renormalized probabilities). Each row draws one
    uniform from its own generator and inverts its CDF, so a seeded request samples the same tokens
    whatever batch it shares."""
    B, V = logits.shape
    temp = torch.tensor([r.temperature for r in rows], dtype=logits.dtype)[:, None]
    logp = torch.log_softmax(logits / temp, dim=-1)
    sp, si = torch.sort(logp.exp(), dim=-1, descending=True)
    ranks = torch.arange(V)[None, :]
    sp = sp.masked_fill(ranks >= torch.tensor([min(r.top_k, V) for r in rows])[:, None], 0.0)
    top_p = torch.tensor([r.top_p for r in rows], dtype=sp.dtype)[:, None]
    sp = sp.masked_fill((torch.cumsum(sp, dim=-1) - sp) > top_p, 0.0)
    cum = torch.cumsum(sp, dim=-1)
    u = torch.stack([torch.rand((), generator=r.gen) for r in rows]).to(cum.dtype)
    pick = torch.searchsorted(cum, (u * cum[:, -1])[:, None]).clamp(max=V - 1)
    toks = si.gather(1, pick)[:, 0]
    greedy = torch.tensor([r.top_k == 1 for r in rows])
    toks = torch.where(greedy, logits.argmax(dim=-1), toks)
    lps = logp.gather(1, toks[:, None])[:, 0]
    return toks.tolist(), lps.tolist()


def abort_reason(message: str) -> dict:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}
