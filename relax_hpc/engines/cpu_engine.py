"""relax_hpc's reference engine (the "CPU engine"): an HF transformers model behind the subset of SGLang's native
HTTP API that relax_hpc uses, on the CPU or on one GPU.

Why it exists: SGLang cannot be installed on CPU-only machines (CI, laptops; see
``reference/ml-cpu-notes.md`` §4), yet the rollout code must be exercised end to end there; and on one GPU box it
runs the whole loop without SGLang. This server speaks the same wire format as SGLang 0.5.23 for the calls in
:mod:`relax_hpc.engines.client`, so the client, the rollout driver and the weight sync cannot tell the two apart.

    python -m relax_hpc.engines.cpu_engine --model DIR [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16|float16]
        [--host 127.0.0.1] [--port 0] [--ready-file F]

Semantics (``docs/engines.md`` has the full list):

* **Batching.** One scheduler thread collects waiting ``/generate`` requests for ``--batch-wait-ms`` (or
  until ``--max-batch-size``), left-pads them, prefills once and decodes the whole batch with the HF KV
  cache; finished rows are dropped from the cache. Requests arriving meanwhile wait for the next batch
  (static batching, no continuous batching).
* **Log-probs.** ``output_token_logprobs[i][0]`` is ``log_softmax(raw_logits / T)[token]`` where ``T`` is the
  request temperature (1 for greedy, as SGLang does), taken *before* top-k/top-p filtering: the value a
  trainer recomputes with a teacher-forced forward at the same temperature. Never HF "scores".
* **Scoring (teacher) requests.** ``logprob_start_len`` K with ``return_logprob`` adds SGLang's
  ``input_token_logprobs`` (positions K..L-1, the first ``null``) and, with ``top_logprobs_num``,
  ``input_top_logprobs``: one teacher-forced forward, ``log_softmax`` of the raw logits (no temperature, as SGLang
  computes input log-probs); with ``max_new_tokens`` 0 nothing is generated (:mod:`~relax_hpc.engines.model_runner`).
* **Images.** A Qwen2.5-VL / Qwen3-VL directory is served with SGLang's ``image_data``; such a request runs alone,
  outside the batches, and its answer adds the expanded prompt ids (:mod:`~relax_hpc.engines.model_runner`). The
  images served at once are bounded: at most ``--image-pixel-budget`` source pixels (read from the headers, before
  decoding); a request that finds no room within ``--image-wait-s`` is answered 503 with ``Retry-After``.
* **Device.** ``--device auto`` puts the model on ``cuda:0`` of the visible GPUs when torch sees one, else on the
  CPU; ``--dtype auto`` is bfloat16 on CUDA, float32 on the CPU. Sampling runs on the CPU either way.
* **Weights.** ``/init_weights_update_group`` joins a group as rank ``rank_offset`` (TP=1) with the backend asked,
  if served (``/server_info``: ``weight_sync_backends``; gloo on the CPU, nccl and gloo on CUDA), and refuses
  any other at once; ``/update_weights_from_distributed`` receives ``dist.broadcast(src=0)`` per tensor or one
  flat buffer (``load_format="flattened_bucket"``), ``/update_weights_from_tensor`` opens CUDA IPC or
  shared-memory handles (:mod:`~relax_hpc.engines.tensor_wire`); both copy by HF parameter name and, as in
  SGLang 0.5.23, are refused outside ``/begin_weight_update`` … ``/end_weight_update``.
* **Memory hand-over.** ``/release_memory_occupation`` frees the weights on CUDA (refused while requests run or
  wait), ``/resume_memory_occupation`` takes them again; while released ``/generate`` is refused and the health
  checks answer without the model. On the CPU the same states, nothing freed.
* **Log of control calls.** One INFO line ``call PATH k=v ...`` per control call and per ``/generate`` call
  (:data:`LOGGED`), written when the call arrives, so the order of calls can be read from the engine's log.
* **API key.** With ``RELAX_ENGINE_API_KEY`` set (or ``--api-key-file``), every request but ``/health*``
  needs ``Authorization: Bearer KEY`` and is answered 401 otherwise, as SGLang's ``--api-key`` does (it
  leaves ``/health`` and ``/health_generate`` open too). The key comes through the environment or a file,
  never argv, so it does not show in ``ps``. It is checked from the headers before the body is read.
* **Bounded connections** (:mod:`relax_hpc.engines.http_server`): at most ``--max-connections`` sockets held at
  once (lowered to the process's file limit); one event-loop thread reads every request's head, and a thread
  serves only a keyed request; a keyless connection is answered 401 at the door, a body claimed over
  ``--max-body-mb`` is answered 413 unread.
* **Bounded image memory.** The pixels of the images being served at once stay within ``--image-pixel-budget``
  (each request reserves its images' pixels from their headers before decoding); a request that finds no room
  waits up to ``--image-wait-s``, then gets 503 with ``Retry-After``; one larger than the whole budget gets 400.

Test hook: ``RELAX_TEST_ENGINE_BAD_OUTPUT=KIND:N[:CLAIM]`` spoils the engine's first ``N`` generate answers
that have something to spoil (tokens, not aborted; log-probs for the log-prob kinds), one way
(:data:`BAD_OUTPUTS`): ``nan_logprobs``, ``positive_logprobs`` or ``no_logprobs`` (the first token's log-prob
NaN, +0.5, or none at all; the first two spoil a scoring answer's first input log-prob too), ``token_past_vocab`` (the first token id = ``vocab_size``), ``empty_output`` (no
tokens, finish reason kept), ``wrong_count`` (``completion_tokens`` one more), and for MoE models with routed
experts ``expert_out_of_range``, ``duplicate_expert``, ``extra_layer`` (``meta_info.routed_experts`` spoilt). With ``CLAIM`` (a file path) only
the engine that creates that file first misbehaves: one engine of a run, and not the one started in its place.

Its parts: :mod:`~relax_hpc.engines.http` (routes, the key check), :mod:`~relax_hpc.engines.scheduler` (batches,
pauses, aborts, the sampler), :mod:`~relax_hpc.engines.model_runner` (the model, request checks, answers),
:mod:`~relax_hpc.engines.receiver` (weight updates); this module wires them into one server process.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import torch

from relax_hpc.engines.http import (API_KEY_ENV, JSON_NULL, EngineServer, HTTPError, advertised_host, ok, read_api_key,
                                   route_handler)
from relax_hpc.engines.http_server import IDLE_S, MAX_BODY, MAX_CONNECTIONS
from relax_hpc.engines.model_runner import IMAGE_PIXEL_BUDGET, IMAGE_WAIT_S, Busy, CPUEngine, brief
from relax_hpc.engines.receiver import weight_routes

log = logging.getLogger("relax_hpc.cpu_engine")

# the calls logged as "call PATH k=v ..." (one INFO line each, when it arrives), with the body fields shown
LOGGED = {
    "/generate": (), "/pause_generation": ("mode",), "/continue_generation": (), "/flush_cache": (),
    "/release_memory_occupation": ("tags",), "/resume_memory_occupation": ("tags",),
    "/begin_weight_update": (), "/end_weight_update": (),
    "/update_weights_from_distributed": ("load_format", "weight_version"),
    "/update_weights_from_tensor": ("load_format", "weight_version"),
    "/update_weights_from_disk": ("model_path", "weight_version"), "/update_weight_version": ("new_version",),
    "/load_lora_adapter_from_tensors": ("lora_name",), "/load_lora_adapter": ("lora_name", "lora_path"),
    "/unload_lora_adapter": ("lora_name",),
}


def logged(path: str, fn, fields: tuple[str, ...]):
    """``fn`` that first logs ``call PATH k=v ...`` (``n=`` the number of prompts for /generate, ``tensors=`` of
    names for a distributed update), and a refusal (4xx) as a warning."""
    def call(b: dict):
        extra = [f"{k}={b.get(k)}" for k in fields]
        if path == "/generate":
            ids, text = b.get("input_ids"), b.get("text")
            batched = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
            extra.append(f"n={len(ids if ids is not None else text) if batched else 1}")
        elif path == "/update_weights_from_distributed":
            extra.append(f"tensors={len(b.get('names') or [])}")
        log.info("call %s%s", path, "".join(" " + e for e in extra))
        try:
            status, data = fn(b)
        except HTTPError as e:
            log.warning("refused %s (%d): %s", path, e.status, e.message)
            raise
        if status >= 400 and path != "/generate":
            message = data.get("message") if isinstance(data, dict) else data
            log.warning("refused %s (%d): %s", path, status, message)
        return status, data
    return call


def lora_route(engine: CPUEngine, call_name: str = "load_lora_adapter_from_tensors"):
    def call(b):  # SGLang answers {"success", "message"}: 200, or 400 when it failed
        success, message = getattr(engine, call_name)(b)
        return (200 if success else 400), {"success": success, "message": message}
    return call


def engine_handler(engine: CPUEngine, api_key: str | None = None):

    def flush(_):
        success, message = engine.flush_cache()
        return (200 if success else 400), message

    def pause(b):
        mode = b.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise HTTPError(400, f"mode must be abort, retract or in_place, not {brief(mode)}")
        engine.scheduler.pause(mode)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def cont(_):
        engine.scheduler.resume()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def abort(b):
        if b.get("abort_all"):
            engine.abort(None, "Abort by abort_request (abort_all).")
        elif b.get("rid"):
            engine.abort(str(b["rid"]), "Abort by abort_request.")
        return 200, None

    def health(_):
        return (200 if engine.health_generate() else 503), None

    def memory(fn):
        def call(b):  # SGLang answers these 200 with a JSON null, an error object (400) otherwise
            fn(b)
            return 200, JSON_NULL
        return call

    def generate(b):
        _answer.retry_after = None
        try:
            return ok(engine.generate(b))
        except Busy as e:  # with_retry_after adds its Retry-After
            _answer.retry_after = e.retry_after
            raise

    routes = {
        "/generate": generate,
        "/health": health, "/health_generate": health, "/ready": lambda b: (200, None),
        "/server_info": lambda b: ok(engine.server_info()), "/get_server_info": lambda b: ok(engine.server_info()),
        "/model_info": lambda b: ok(engine.model_info()), "/get_model_info": lambda b: ok(engine.model_info()),
        "/flush_cache": flush, "/pause_generation": pause, "/continue_generation": cont, "/abort_request": abort,
        "/release_memory_occupation": memory(engine.release_memory_occupation),
        "/resume_memory_occupation": memory(engine.resume_memory_occupation),
        **weight_routes(engine),
        "/load_lora_adapter_from_tensors": lora_route(engine),  # SGLang's calls (engines/lora.py)
        "/load_lora_adapter": lora_route(engine, "load_lora_adapter"),
        "/unload_lora_adapter": lora_route(engine, "unload_lora_adapter"),
    }
    routes.update({path: logged(path, routes[path], fields) for path, fields in LOGGED.items() if path in routes})
    return with_retry_after(route_handler(routes, api_key))


_answer = threading.local()  # per handler thread: the Retry-After of the answer being sent


def with_retry_after(base):
    """``base`` (a :func:`~relax_hpc.engines.http.route_handler` class) whose 503 answers carry ``Retry-After`` when
    the route that refused set one (:class:`~relax_hpc.engines.model_runner.Busy`): a route runs in the thread that
    then answers, so a thread-local carries it from one to the other."""

    class Handler(base):
        def send_response(self, code, message=None):
            super().send_response(code, message)
            retry, _answer.retry_after = getattr(_answer, "retry_after", None), None
            if retry is not None and code == 503:
                self.send_header("Retry-After", str(retry))

    return Handler


def serve(engine: CPUEngine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, *,
          max_connections: int = MAX_CONNECTIONS, idle_s: float = IDLE_S, max_body: int = MAX_BODY) -> EngineServer:
    server = EngineServer((host, port), engine_handler(engine, api_key), max_connections=max_connections, idle_s=idle_s,
                     max_body=max_body)
    engine.host, engine.port = host, server.server_address[1]
    engine.url = f"http://{advertised_host(host)}:{engine.port}"
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relax_hpc.engines.cpu_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (config, safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: the kernel picks a free port (default)")
    p.add_argument("--ready-file", help="written (atomically) with the URL once the server accepts requests")
    p.add_argument("--device", default="auto",
                   help="auto (cuda:0 of the visible GPUs when torch sees one, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--weight-sync-backends", default=None,
                   help="the weight-sync group backends served, comma-separated (default: gloo on the CPU, nccl,gloo "
                        "on CUDA); a test hook, so a test can start an engine that serves only one")
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
                   help="sockets held at once (lowered to the file limit); threads only for keyed requests")
    p.add_argument("--idle-timeout-s", type=float, default=IDLE_S,
                   help="a connection that owes its request (or the rest of it) this long is closed")
    p.add_argument("--max-body-mb", type=float, default=MAX_BODY / (1 << 20),
                   help="a request claiming a larger body is answered 413 without reading it")
    p.add_argument("--image-pixel-budget", type=int, default=IMAGE_PIXEL_BUDGET,
                   help="source pixels (width × height) of the images of the requests served at once; a request "
                        "that does not fit waits, then is answered 503 with Retry-After")
    p.add_argument("--image-wait-s", type=float, default=IMAGE_WAIT_S,
                   help="how long a request with images waits for room in --image-pixel-budget before the 503")
    a = p.parse_args(argv)
    api_key = read_api_key(a.api_key_file)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cpu_engine %(levelname)s %(message)s")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    backends = [b.strip() for b in a.weight_sync_backends.split(",") if b.strip()] if a.weight_sync_backends else None
    if backends and not set(backends) <= {"nccl", "gloo"}:
        p.error(f"--weight-sync-backends {a.weight_sync_backends}: each must be nccl or gloo")
    try:
        engine = CPUEngine(a.model, a.dtype, a.max_batch_size, a.batch_wait_ms, a.seed, a.weight_version,
                           a.served_model_name, device=a.device, weight_sync_backends=backends,
                           image_pixel_budget=a.image_pixel_budget, image_wait_s=a.image_wait_s)
    except ValueError as e:  # --device / --dtype that cannot be served here
        p.error(str(e))
    if a.sglang_version:
        from relax_hpc.engines.client import update_protocol

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
    dtype = str(engine.dtype).replace("torch.", "")
    print(f"relax_hpc reference engine ready at {engine.url} (pid {os.getpid()}, model {a.model}, device "
          f"{engine.device}, dtype {dtype}, API key {'required' if api_key else 'off'})", flush=True)
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


if __name__ == "__main__":
    sys.exit(main())
