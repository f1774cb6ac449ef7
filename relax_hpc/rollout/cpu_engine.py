"""relax_hpc's CPU engine: an HF transformers model behind the subset of SGLang's native HTTP API that relax_hpc uses.

Why it exists: SGLang cannot be installed on CPU-only machines (CI, laptops; see
``reference/ml-cpu-notes.md`` §4), yet the rollout code must be exercised end to end there. This server
speaks the same wire format as SGLang 0.5.23 for the calls in :mod:`relax_hpc.rollout.client`, so the
client, the rollout driver and the weight sync cannot tell the two apart.

    python -m relax_hpc.rollout.cpu_engine --model DIR [--host 127.0.0.1] [--port 0] [--ready-file F]

Semantics (``docs/engines.md`` has the full list):

* **Batching.** One scheduler thread collects waiting ``/generate`` requests for ``--batch-wait-ms`` (or
  until ``--max-batch-size``), left-pads them, prefills once and decodes the whole batch with the HF KV
  cache; finished rows are dropped from the cache. Requests arriving meanwhile wait for the next batch
  (static batching, no continuous batching).
* **Log-probs.** ``output_token_logprobs[i][0]`` is ``log_softmax(raw_logits / T)[token]`` where ``T`` is the
  request temperature (1 for greedy, as SGLang does), taken *before* top-k/top-p filtering: the value a
  trainer recomputes with a teacher-forced forward at the same temperature. Never HF "scores".
* **Weights.** ``/init_weights_update_group`` joins a gloo group as rank ``rank_offset`` (TP=1; "nccl" is
  served by gloo), ``/update_weights_from_distributed`` receives ``dist.broadcast(src=0)`` per tensor or
  one flat buffer (``load_format="flattened_bucket"``) and copies by HF parameter name; as in SGLang
  0.5.23 it is refused outside ``/begin_weight_update`` … ``/end_weight_update``.
* **API key.** With ``RELAX_ENGINE_API_KEY`` set (or ``--api-key-file``), every request but ``/health*``
  needs ``Authorization: Bearer KEY`` and is answered 401 otherwise, as SGLang's ``--api-key`` does (it
  leaves ``/health`` and ``/health_generate`` open too). The key comes through the environment or a file,
  never argv, so it does not show in ``ps``. It is checked from the headers before the body is read.
* **Bounded connections** (:mod:`relax_hpc.rollout.http_server`): at most ``--max-connections`` served at once
  (one thread each; more are answered 503 at once), a connection that owes its request for
  ``--idle-timeout-s`` is closed, a body claimed over ``--max-body-mb`` is answered 413 unread.

Test hook: ``RELAX_TEST_ENGINE_BAD_OUTPUT=KIND:N[:CLAIM]`` spoils the engine's first ``N`` generate answers
that have something to spoil (tokens, not aborted; log-probs for the log-prob kinds), one way
(:data:`BAD_OUTPUTS`): ``nan_logprobs``, ``positive_logprobs`` or ``no_logprobs`` (the first token's log-prob
NaN, +0.5, or none at all), ``token_past_vocab`` (the first token id = ``vocab_size``), ``empty_output`` (no
tokens, finish reason kept), ``wrong_count`` (``completion_tokens`` one more). With ``CLAIM`` (a file path) only
the engine that creates that file first misbehaves: one engine of a run, and not the one started in its place.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import torch

from relax_hpc.rollout.http_server import IDLE_S, MAX_BODY, MAX_CONNECTIONS, BoundedHandler, BoundedServer

log = logging.getLogger("relax_hpc.cpu_engine")

SAMPLING_EPS = 1e-6  # SGLang: temperature below this means greedy (temperature 1, top_k 1)
TOP_K_ALL = 1 << 30  # SGLang's "top_k off" value (1073741824); -1 also means off
ENGINE_VERSION = "relax_hpc-cpu-engine/1"

# SGLang 0.5.23 SamplingParams keys (unknown keys are rejected, as SGLang does). The ones in _SUPPORTED
# change what we generate; the others are accepted only at a neutral value (None, default, empty).
_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
}
_SUPPORTED = {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "ignore_eos",
              "sampling_seed", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
              "stream_interval", "custom_params"}
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0, "n": 1}


class HTTPError(Exception):
    """An error answered as SGLang does: ``{"error": {"message": ...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# --------------------------------------------------------------------------------------------- process groups

def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = "weight_update_group", backend: str = "gloo",
                             timeout_s: float = 600.0):
    """Create a torch.distributed group *beside* the default one, the way SGLang's engine joins its weight group.

    Both ends (trainer rank 0 and every engine rank) must build the group the same way: a TCPStore
    rendezvous at ``tcp://master_address:master_port`` (rank 0 hosts it), keys under a
    ``PrefixStore(group_name)``, and registration in torch's group table so ``dist.broadcast(..., group=g)``
    works. It never touches the default process group, so a trainer that already has one (Megatron) and a
    pytest process can both use it. Uses private torch API like SGLang/OpenRLHF/verl do; torch 2.13 checked.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    assert pg.rank() == rank and pg.size() == world_size
    return pg


def flat_bucket_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """dtype of SGLang's flattened bucket: what ``torch.cat`` of the flattened tensors promotes to."""
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def _resolve_dtype(name) -> torch.dtype:
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise HTTPError(400, f"unknown dtype {name!r}")
    return dt


# --------------------------------------------------------------------------------------------- test hook

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
        if not out["output_ids"] or (meta["finish_reason"] or {}).get("type") == "abort" \
                or (not rows and self.kind.endswith("logprobs")):
            return  # nothing of that kind to spoil here: the next answer
        with self.lock:
            if self.left <= 0:
                return
            self.left -= 1
        if self.kind in ("nan_logprobs", "positive_logprobs"):
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


# --------------------------------------------------------------------------------------------- requests

class _Req:
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
        self.created = time.monotonic()
        self.done = threading.Event()

    def finish_with(self, reason: dict, weight_version: str) -> None:
        self.finish = reason
        self.weight_version = weight_version
        self.done.set()


# --------------------------------------------------------------------------------------------- scheduler

class Scheduler:
    """Static batching over one HF model. Pause modes follow SGLang: ``abort`` finishes everything in flight
    as aborted, ``in_place`` parks the running batch with its KV cache, ``retract`` puts running requests
    back in the queue (their KV is dropped and recomputed, with whatever weights are loaded by then)."""

    def __init__(self, engine: "CPUEngine", max_batch: int, batch_wait_s: float):
        self.engine = engine
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.cv = threading.Condition()
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.paused: str | None = None
        self.parked = False
        self.stats = {"num_batches": 0, "max_batch_size": 0, "num_requests": 0, "num_generated_tokens": 0,
                      "last_gen_throughput": 0.0}
        self.thread = threading.Thread(target=self._loop, name="cpu-engine-scheduler", daemon=True)

    # -- called from HTTP threads
    def submit(self, reqs: list[_Req]) -> None:
        with self.cv:
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
                    r.finish_with(_abort_reason(message), self.engine.weight_version)
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

    def _control(self, rows: list[_Req]) -> str:
        """Between decode steps: apply aborts and pause. Returns "go", "retract" or "done"."""
        eng = self.engine
        with self.cv:
            while True:
                for r in rows:
                    if r.abort_message is not None and not r.done.is_set():
                        r.finish_with(_abort_reason(r.abort_message), eng.weight_version)
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
    def _run(self, batch: list[_Req]) -> None:
        eng = self.engine
        rows = list(batch)
        seqs = [r.input_ids + r.output_ids for r in rows]  # output_ids is non-empty after a retract
        B, L = len(seqs), max(map(len, seqs))
        ids = torch.full((B, L), eng.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, L - len(s):] = torch.tensor(s)
            mask[i, L - len(s):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with eng.model_lock:
            out = eng.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :].float()
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
                idx = torch.tensor(keep, dtype=torch.long)
                cache.batch_select_indices(idx)
                mask, pos = mask[idx], pos[idx]
                rows = [rows[i] for i in keep]
                next_tokens = [next_tokens[i] for i in keep]
                with self.cv:
                    self.running = list(rows)
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            pos = pos + 1
            with eng.model_lock:
                out = eng.model(input_ids=torch.tensor(next_tokens)[:, None], attention_mask=mask,
                                position_ids=pos, past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1, :].float()


def sample_batch(rows: list[_Req], logits: torch.Tensor) -> tuple[list[int], list[float]]:
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


def _abort_reason(message: str) -> dict:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


# --------------------------------------------------------------------------------------------- engine

class WeightReceiver:
    """The receiving side of SGLang's weight-update API, by HF parameter name into ``params``: groups, update
    sessions, the updates themselves, the version tag. The CPU engine is one; a forward role following the actor
    (:mod:`relax_hpc.weights.follower`) is another, so both answer the sender with this one wire format."""

    device = "cpu"  # where broadcasts land
    # SGLang before 0.5.23 (``--sglang-version``): no update sessions; the updates come alone
    legacy_updates = False
    reported_version: str | None = None  # what /server_info says the version is (``--sglang-version``)

    def __init__(self, params: dict[str, torch.Tensor], weight_version: str = "default"):
        self.params = params  # HF names → live tensors (tied names included)
        self.weight_version = weight_version
        self.model_lock = threading.Lock()  # readers of params vs weight loads
        self.groups: dict[str, object] = {}
        self.session = False
        self.session_lock = threading.Lock()

    def backend(self, body: dict) -> str:
        """The group's backend: gloo here whatever was asked ("nccl" is served by gloo on CPU)."""
        return "gloo"

    def abort_all(self, message: str) -> None:
        """Requests in flight when an update asks to abort them (an engine has some)."""

    def loaded(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Called after tensors were copied into ``params``."""

    def init_weights_update_group(self, body: dict) -> tuple[bool, str]:
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            return False, f"weight update group {name!r} already exists"
        try:
            pg = init_weight_update_group(body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
                                          int(body["world_size"]), name, backend=self.backend(body),
                                          timeout_s=float(body.get("timeout", 600.0)))
        except KeyError as e:
            return False, f"missing field {e}"
        except Exception as e:
            return False, f"Failed to init process group: {type(e).__name__}: {e}"
        self.groups[name] = pg
        return True, (f"Succeeded to initialize custom process group (rank {body['rank_offset']} of "
                      f"{body['world_size']}, backend {self.backend(body)}; requested {body.get('backend', 'nccl')}).")

    def destroy_weights_update_group(self, body: dict) -> tuple[bool, str]:
        import torch.distributed as dist
        pg = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            return False, "no such weight update group"
        dist.destroy_process_group(pg)
        return True, "Succeeded to destroy custom process group."

    def begin_weight_update(self) -> tuple[bool, str]:
        with self.session_lock:
            if self.session:
                return False, "A weight update session is already active; call end_weight_update() first."
            self.session = True
        return True, "Weight update session started."

    def end_weight_update(self) -> tuple[bool, str]:
        with self.session_lock:
            if not self.session:
                return False, "No weight update session is active; call begin_weight_update() first."
            self.session = False
        return True, "Weight update session ended."

    def update_weights_from_distributed(self, body: dict) -> tuple[bool, str]:
        import torch.distributed as dist
        if not self.session and not self.legacy_updates:
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update().")
        group_name = body.get("group_name", "weight_update_group")
        pg = self.groups.get(group_name)
        if pg is None:
            return False, (f"Group {group_name} not in {list(self.groups)}. "
                           "Please call `init_weights_update_group` first.")
        names, shapes = list(body.get("names") or []), [list(s) for s in body.get("shapes") or []]
        dtypes = [_resolve_dtype(d) for d in body.get("dtypes") or []]
        if not names or not (len(names) == len(dtypes) == len(shapes)):
            return False, (f"names, dtypes and shapes must be non-empty and equally long "
                           f"({len(names)}, {len(dtypes)}, {len(shapes)})")
        if body.get("abort_all_requests"):
            self.abort_all("Abort by update_weights_from_distributed (abort_all_requests).")
        fmt = body.get("load_format")
        # Receive everything the trainer sends before judging names/shapes: refusing halfway would hang its broadcast.
        if fmt == "flattened_bucket":
            numels = [int(torch.Size(s).numel()) for s in shapes]
            flat = torch.empty(sum(numels), dtype=flat_bucket_dtype(dtypes), device=self.device)
            dist.broadcast(flat, src=0, group=pg)
            tensors, off = [], 0
            for s, d, k in zip(shapes, dtypes, numels):
                tensors.append(flat[off:off + k].view(s).to(d))
                off += k
        elif fmt in (None, "", "direct"):
            tensors = [torch.empty(s, dtype=d, device=self.device) for s, d in zip(shapes, dtypes)]
            works = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
            for w in works:
                w.wait()
        else:
            return False, f"load_format {fmt!r} is not supported by the CPU engine (null or 'flattened_bucket')"
        self.load_named(list(zip(names, tensors)))
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return True, f"Succeeded to update parameter online ({len(names)} tensors)."

    def update_weights_from_disk(self, body: dict) -> tuple[bool, str]:
        from safetensors.torch import load_file
        path = Path(body.get("model_path") or "")
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return False, f"Failed to update weights: no *.safetensors files in model_path {str(path)!r}"
        if body.get("abort_all_requests"):
            self.abort_all("Abort by update_weights_from_disk (abort_all_requests).")
        named = [kv for f in files for kv in load_file(str(f)).items()]
        self.load_named(named)
        self.model_path = str(path)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return True, f"Succeeded to update model weights from {path} ({len(named)} tensors)."

    def load_named(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model by HF name; all are checked before any is copied."""
        for name, t in named:
            p = self.params.get(name)
            if p is None:
                raise HTTPError(400, f"unknown parameter {name!r} (not in the HF model's state_dict)")
            if tuple(p.shape) != tuple(t.shape):
                raise HTTPError(400, f"shape mismatch for {name}: model {tuple(p.shape)}, received {tuple(t.shape)}")
        with self.model_lock, torch.no_grad():
            for name, t in named:
                self.params[name].data.copy_(t)
        self.loaded(named)

    def get_weights_by_name(self, body: dict):
        name = body.get("name")
        p = self.params.get(name)
        if p is None:
            raise HTTPError(400, f"unknown parameter {name!r}")
        return p.detach()[: int(body.get("truncate_size", 100))].float().tolist()




class CPUEngine(WeightReceiver):
    """The model, its weights and the endpoint logic (HTTP-free, so it reads like SGLang's request structs)."""

    def __init__(self, model_path: str, dtype: str = "float32", max_batch: int = 64, batch_wait_ms: float = 5.0,
                 seed: int | None = None, weight_version: str = "default", served_model_name: str | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_path = str(model_path)
        self.served_model_name = served_model_name or self.model_path
        self.dtype = getattr(torch, dtype)
        self.config = AutoConfig.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).eval()
        self.model.requires_grad_(False)
        super().__init__(self.model.state_dict(keep_vars=True), weight_version)
        self.tokenizer = _load_tokenizer(self.model_path)
        self.vocab_size = int(self.config.vocab_size)
        self.context_len = int(getattr(self.config, "max_position_embeddings", 4096))
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        self.rng = random.Random(seed)
        spec = os.environ.get(BAD_OUTPUT_ENV)
        self.bad_output = BadOutput(spec, self.vocab_size) if spec else None
        self.started = time.time()
        self.scheduler = Scheduler(self, max_batch, batch_wait_ms / 1000.0)
        self.scheduler.thread.start()
        self.host, self.port, self.url = "", 0, ""

    # ------------------------------------------------------------------ generate
    def finish_reason(self, r: _Req, tok: int) -> dict | None:
        # SGLang order: the length check wins over a matched stop token on the last position.
        if len(r.output_ids) >= r.max_new_tokens:
            return {"type": "length", "length": r.max_new_tokens}
        if (tok in self.eos_ids and not r.ignore_eos) or tok in r.stop_ids:
            return {"type": "stop", "matched": tok}
        if r.stop_strs:  # decode a tail long enough to hold any stop string (a token is at least one char here)
            tail = self.tokenizer.decode(r.output_ids[-(max(map(len, r.stop_strs)) + 8):],
                                         skip_special_tokens=r.skip_special_tokens)
            for s in r.stop_strs:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None

    def generate(self, body: dict):
        if body.get("stream"):
            raise HTTPError(400, "stream=true is not supported by the CPU engine")
        if body.get("top_logprobs_num"):
            raise HTTPError(400, "top_logprobs_num is not supported by the CPU engine")
        has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
        if has_ids == has_text:
            raise HTTPError(400, "Either text or input_ids should be provided (exactly one).")
        if has_text:
            if self.tokenizer is None:
                raise HTTPError(400, "text input needs a tokenizer in the model directory; send input_ids")
            texts = body["text"]
            batched = isinstance(texts, list)
            prompts = [self.tokenizer.encode(t) for t in (texts if batched else [texts])]
        else:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise HTTPError(400, "input_ids must be a non-empty list of token ids (or a list of such lists)")
            batched = isinstance(ids[0], list)
            prompts = ids if batched else [ids]
        n = len(prompts)
        sps, rlps, rids = (_per_item(body.get(k), n, k) for k in ("sampling_params", "return_logprob", "rid"))
        text_in_lp = bool(body.get("return_text_in_logprobs"))
        reqs = [self._make_req(p, sp or {}, bool(lp), rid) for p, sp, lp, rid in zip(prompts, sps, rlps, rids)]
        todo = [r for r in reqs if not r.done.is_set()]
        self.scheduler.submit(todo)
        for r in reqs:
            r.done.wait()
        errors = [r.error for r in reqs if r.error]
        if errors:
            raise HTTPError(500, f"generation failed: {errors[0]}")
        outs = [self._response(r, text_in_lp) for r in reqs]
        if self.bad_output is not None:
            for o in outs:
                self.bad_output.spoil(o)
        return outs if batched else outs[0]

    def _make_req(self, input_ids, sp: dict, return_logprob: bool, rid) -> _Req:
        if not input_ids or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in input_ids):
            raise HTTPError(400, f"input_ids must be a non-empty list of ints in [0, {self.vocab_size})")
        sp = _check_sampling(sp)
        if sp["stop"] and self.tokenizer is None:
            raise HTTPError(400, "stop strings need a tokenizer in the model directory; use stop_token_ids")
        if len(input_ids) >= self.context_len:
            raise HTTPError(400, f"The input ({len(input_ids)} tokens) is longer than the model's context "
                                 f"length ({self.context_len} tokens).")
        if sp["max_new_tokens"] is None:
            sp["max_new_tokens"] = self.context_len - len(input_ids)
        if sp["max_new_tokens"] + len(input_ids) > self.context_len:
            raise HTTPError(400, f"Requested token count exceeds the model's maximum context length of "
                                 f"{self.context_len} tokens: {len(input_ids)} prompt + {sp['max_new_tokens']} new.")
        seed = sp["sampling_seed"]
        gen = torch.Generator().manual_seed(int(seed) if seed is not None else self.rng.getrandbits(63))
        r = _Req(str(rid) if rid else uuid.uuid4().hex, list(input_ids), sp, return_logprob, gen)
        if r.max_new_tokens == 0:
            r.finish_with({"type": "length", "length": 0}, self.weight_version)
        return r

    def _response(self, r: _Req, text_in_lp: bool) -> dict:
        meta = {"id": r.rid, "finish_reason": r.finish, "prompt_tokens": len(r.input_ids),
                "completion_tokens": len(r.output_ids), "cached_tokens": 0, "weight_version": r.weight_version,
                "e2e_latency": time.monotonic() - r.created}
        if r.return_logprob:
            dec = (lambda t: self.tokenizer.decode([t])) if (text_in_lp and self.tokenizer) else (lambda t: None)
            meta["output_token_logprobs"] = [[lp, t, dec(t)] for lp, t in zip(r.logprobs, r.output_ids)]
        out = {"output_ids": r.output_ids, "meta_info": meta}
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=r.skip_special_tokens)
            m = (r.finish or {}).get("matched")
            if isinstance(m, str) and not r.no_stop_trim and m in text:  # SGLang trims a matched stop string
                text = text[:text.rindex(m)]
            out = {"text": text, **out}
        return out

    def health_generate(self, timeout_s: float = 20.0) -> bool:
        """A 1-token forward of ``input_ids=[0]`` (SGLang's default health check generates one token).

        It runs between decode steps instead of queueing behind a batch: with static batching a long batch
        would otherwise make a healthy engine look dead (SGLang's continuous batching answers at once). It
        answers while paused too, as the model is still there."""
        if not self.model_lock.acquire(timeout=timeout_s):
            return False
        try:
            with torch.inference_mode():
                logits = self.model(input_ids=torch.tensor([[0]])).logits[0, -1]
            return bool(torch.isfinite(logits).all())
        except Exception:
            log.error("health check failed: %s", traceback.format_exc())
            return False
        finally:
            self.model_lock.release()

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> tuple[bool, str]:
        running, waiting = self.scheduler.busy()
        if running or (waiting and self.scheduler.paused is None):
            return False, (f"Cache not flushed because there are pending requests: #queue-req: {waiting}, "
                           f"#running-req: {running}")
        return True, "Cache flushed.\nPlease check backend logs for more details. (When there are running or " \
                     "waiting requests, the operation will not be performed.)\n"

    def server_info(self) -> dict:
        running, waiting = self.scheduler.busy()
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name, "host": self.host, "port": self.port, "tp_size": 1,
            "dp_size": 1, "device": "cpu",
            "dtype": str(self.dtype).replace("torch.", ""), "context_length": self.context_len,
            "skip_tokenizer_init": self.tokenizer is None, "max_running_requests": self.scheduler.max_batch,
            "launch_command": " ".join(sys.argv), "status": "ready", "max_total_num_tokens": None,
            "max_req_input_len": self.context_len - 1, "startup_time": self.started,
            "internal_states": [{"last_gen_throughput": self.scheduler.stats["last_gen_throughput"],
                                 "num_running_reqs": running, "num_waiting_reqs": waiting,
                                 "paused": self.scheduler.paused, **self.scheduler.stats}],
            "version": self.reported_version or ENGINE_VERSION, "engine": "relax_hpc-cpu", "frontend": "python",
        }

    def abort_all(self, message: str) -> None:
        self.scheduler.abort(None, message)

    def model_info(self) -> dict:
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "load_format": "safetensors", "model_type": getattr(self.config, "model_type", None),
            "architectures": getattr(self.config, "architectures", None), "has_image_understanding": False,
            "has_audio_understanding": False,
        }

def _check_sampling(sp: dict) -> dict:
    if not isinstance(sp, dict):
        raise HTTPError(400, "sampling_params must be an object")
    unknown = set(sp) - _SAMPLING_KEYS
    if unknown:
        raise HTTPError(400, f"unknown sampling_params keys: {sorted(unknown)}")
    for k, v in sp.items():
        if k in _SUPPORTED or v in (None, "", [], {}) or (k in _NEUTRAL and v == _NEUTRAL[k]):
            continue
        raise HTTPError(400, f"sampling param {k}={v!r} is not supported by the CPU engine")
    out = {"max_new_tokens": sp.get("max_new_tokens", 128), "temperature": sp.get("temperature", 1.0),
           "top_p": sp.get("top_p", 1.0), "top_k": sp.get("top_k", -1), "stop_token_ids": sp.get("stop_token_ids"),
           "ignore_eos": sp.get("ignore_eos", False), "sampling_seed": sp.get("sampling_seed"),
           "stop": [sp["stop"]] if isinstance(sp.get("stop"), str) and sp["stop"] else list(sp.get("stop") or []),
           "skip_special_tokens": sp.get("skip_special_tokens", True), "no_stop_trim": sp.get("no_stop_trim", False)}
    if out["top_k"] in (-1, None) or out["top_k"] >= TOP_K_ALL:
        out["top_k"] = TOP_K_ALL
    if out["max_new_tokens"] is not None and out["max_new_tokens"] < 0:
        raise HTTPError(400, "max_new_tokens must be at least 0")
    if out["temperature"] < 0:
        raise HTTPError(400, "temperature must be non-negative")
    if not 0 < out["top_p"] <= 1:
        raise HTTPError(400, "top_p must be in (0, 1]")
    if out["top_k"] < 1:
        raise HTTPError(400, "top_k must be -1 (disable), or at least 1")
    return out


def _per_item(v, n: int, key: str) -> list:
    """SGLang batch fields: one value for all items, or a list with one value per item."""
    if isinstance(v, list):
        if len(v) != n:
            raise HTTPError(400, f"{key} has {len(v)} items for a batch of {n}")
        return v
    if key == "rid" and n > 1 and v is not None:
        raise HTTPError(400, "a batch needs one rid per item")
    return [v] * n


def _load_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # no tokenizer in the dir: like SGLang's --skip-tokenizer-init, no "text"
        log.warning("no tokenizer loaded from %s (%s): responses carry no text", path, e)
        return None


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        ids.update(e if isinstance(e, (list, tuple)) else ([e] if e is not None else []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


# --------------------------------------------------------------------------------------------- HTTP

API_KEY_ENV = "RELAX_ENGINE_API_KEY"
_OPEN_PREFIXES = ("/health",)  # as SGLang's add_api_key_middleware: health checks need no key


def ok(data):
    return 200, data


def weight_routes(receiver: WeightReceiver) -> dict:
    """The weight-update endpoints of SGLang's HTTP API (groups, sessions, updates, version, read-back)."""
    def result(fn, **extra):
        """Weight/session endpoints answer {"success", "message"} with 200/400, never an error object."""
        def call(b):
            try:
                success, message = fn(b)
            except HTTPError as e:
                success, message = False, e.message
            return (200 if success else 400), {"success": success, "message": message, **extra}
        return call

    def version(b):
        if b.get("abort_all_requests", True):
            receiver.abort_all("Abort by update_weight_version.")
        receiver.weight_version = str(b["new_version"])
        return 200, {"success": True, "message": "Weight version updated.", "new_version": receiver.weight_version}

    return {
        "/init_weights_update_group": result(receiver.init_weights_update_group),
        "/destroy_weights_update_group": result(receiver.destroy_weights_update_group),
        **({} if receiver.legacy_updates else {  # older SGLang has no such routes: 404, as there
            "/begin_weight_update": result(lambda b: receiver.begin_weight_update()),
            "/end_weight_update": result(lambda b: receiver.end_weight_update())}),
        "/update_weights_from_distributed": result(receiver.update_weights_from_distributed),
        "/update_weights_from_disk": result(receiver.update_weights_from_disk, num_paused_requests=0),
        "/update_weight_version": version,
        "/get_weights_by_name": lambda b: ok(receiver.get_weights_by_name(b)),
    }


def _make_handler(engine: CPUEngine, api_key: str | None = None):

    def flush(_):
        success, message = engine.flush_cache()
        return (200 if success else 400), message

    def pause(b):
        mode = b.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise HTTPError(400, f"mode must be abort, retract or in_place, not {mode!r}")
        engine.scheduler.pause(mode)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def cont(_):
        engine.scheduler.resume()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def abort(b):
        if b.get("abort_all"):
            engine.scheduler.abort(None, "Abort by abort_request (abort_all).")
        elif b.get("rid"):
            engine.scheduler.abort(str(b["rid"]), "Abort by abort_request.")
        return 200, None

    def health(_):
        return (200 if engine.health_generate() else 503), None

    routes = {
        "/generate": lambda b: ok(engine.generate(b)),
        "/health": health, "/health_generate": health, "/ready": lambda b: (200, None),
        "/server_info": lambda b: ok(engine.server_info()), "/get_server_info": lambda b: ok(engine.server_info()),
        "/model_info": lambda b: ok(engine.model_info()), "/get_model_info": lambda b: ok(engine.model_info()),
        "/flush_cache": flush, "/pause_generation": pause, "/continue_generation": cont, "/abort_request": abort,
        **weight_routes(engine),
    }
    return route_handler(routes, api_key)


def route_handler(routes: dict, api_key: str | None = None):
    """An HTTP handler class answering ``routes`` (path → fn(body) → (status, data)) as SGLang answers, on a
    :class:`_Server`: the key is checked from the headers before the body is read, the body is bounded
    (:mod:`relax_hpc.rollout.http_server`)."""

    class Handler(BoundedHandler):
        server_version = ENGINE_VERSION

        def _send(self, status: int, data) -> None:
            if data is None:
                payload, ctype = b"", "application/json"
            elif isinstance(data, str):
                payload, ctype = data.encode(), "text/plain; charset=utf-8"
            else:
                payload, ctype = json.dumps(data).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _dispatch(self) -> None:
            path = urlsplit(self.path).path
            raw = self.read_body(api_key, _OPEN_PREFIXES)
            if raw is None:  # refused (401, 413, ...) or the peer stopped sending: answered or nothing to answer
                return
            fn = routes.get(path)
            if fn is None:
                return self._send(404, {"error": {"message": f"no endpoint {path} on the CPU engine"}})
            try:
                body = json.loads(raw) if raw.strip() else {}
                if not isinstance(body, dict):
                    raise HTTPError(400, "request body must be a JSON object")
                status, data = fn(body)
            except HTTPError as e:
                status, data = e.status, {"error": {"message": e.message}}
            except json.JSONDecodeError as e:
                status, data = 400, {"error": {"message": f"invalid JSON body: {e}"}}
            except Exception as e:
                log.error("%s failed: %s", path, traceback.format_exc())
                status, data = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
            try:
                self._send(status, data)
            except OSError:
                self.close_connection = True  # the client gave up (its deadline) or stopped reading

        do_GET = do_POST = do_PUT = _dispatch

    return Handler


class _Server(BoundedServer):
    """The CPU engine's (and the weight follower's) HTTP server: a :class:`BoundedServer`."""


def advertised_host(host: str) -> str:
    """The host name others should use: a wildcard bind is reachable under this machine's name."""
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


def serve(engine: CPUEngine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, *,
          max_connections: int = MAX_CONNECTIONS, idle_s: float = IDLE_S, max_body: int = MAX_BODY) -> _Server:
    server = _Server((host, port), _make_handler(engine, api_key), max_connections=max_connections, idle_s=idle_s,
                     max_body=max_body)
    engine.host, engine.port = host, server.server_address[1]
    engine.url = f"http://{advertised_host(host)}:{engine.port}"
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relax_hpc.rollout.cpu_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (config, safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: the kernel picks a free port (default)")
    p.add_argument("--ready-file", help="written (atomically) with the URL once the server accepts requests")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long a batch gathers concurrent requests")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    p.add_argument("--seed", type=int, default=None, help="seeds requests that carry no sampling_seed")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--sglang-version", default=None,
                   help="answer as this SGLang release does: /server_info reports it, and before 0.5.23 there "
                        "are no /begin_weight_update and /end_weight_update (updates come alone), so the tests "
                        "cover both update protocols")
    p.add_argument("--api-key-file", default=None,
                   help=f"file holding the API key clients must send (default: ${API_KEY_ENV}; neither: no key)")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help="connections served at once, one thread each; more are answered 503 at once")
    p.add_argument("--idle-timeout-s", type=float, default=IDLE_S,
                   help="a connection that owes its request (or the rest of it) this long is closed")
    p.add_argument("--max-body-mb", type=float, default=MAX_BODY / (1 << 20),
                   help="a request claiming a larger body is answered 413 without reading it")
    a = p.parse_args(argv)
    api_key = _read_api_key(a.api_key_file)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cpu_engine %(levelname)s %(message)s")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    engine = CPUEngine(a.model, a.dtype, a.max_batch_size, a.batch_wait_ms, a.seed, a.weight_version,
                       a.served_model_name)
    if a.sglang_version:
        from relax_hpc.rollout.client import update_protocol

        engine.reported_version = a.sglang_version
        try:
            engine.legacy_updates = update_protocol(a.sglang_version) == "plain"
        except ValueError:  # older than relax_hpc supports: answer as that release would; the sender refuses it
            engine.legacy_updates = True
    server = serve(engine, a.host, a.port, api_key=api_key, max_connections=a.max_connections,
                   idle_s=a.idle_timeout_s, max_body=int(a.max_body_mb * (1 << 20)))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    if a.ready_file:
        tmp = Path(a.ready_file + ".tmp")
        tmp.write_text(engine.url + "\n")
        os.replace(tmp, a.ready_file)
    print(f"relax_hpc cpu engine ready at {engine.url} (pid {os.getpid()}, model {a.model}, "
          f"API key {'required' if api_key else 'off'})", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    log.info("stopped")
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)  # nothing left to save; skip seconds of torch/gloo interpreter teardown so stop() is quick


def _read_api_key(path: str | None) -> str | None:
    """The key from ``--api-key-file`` or ``$RELAX_ENGINE_API_KEY`` (taken out of the environment once read)."""
    env_key = os.environ.pop(API_KEY_ENV, None)
    if path:
        key = Path(path).read_text().strip()
        if not key:
            raise SystemExit(f"--api-key-file {path} is empty")
        return key
    return env_key or None


if __name__ == "__main__":
    sys.exit(main())
