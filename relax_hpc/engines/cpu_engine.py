"""relax_hpc's CPU engine: an HF transformers model behind the subset of SGLang's native HTTP API that relax_hpc uses.

Why it exists: SGLang cannot be installed on CPU-only machines (CI, laptops; see
``reference/ml-cpu-notes.md`` §4), yet the rollout code must be exercised end to end there. This server
speaks the same wire format as SGLang 0.5.23 for the calls in :mod:`relax_hpc.engines.client`, so the
client, the rollout driver and the weight sync cannot tell the two apart.

    python -m relax_hpc.engines.cpu_engine --model DIR [--host 127.0.0.1] [--port 0] [--ready-file F]

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
* **Bounded connections** (:mod:`relax_hpc.engines.http_server`): at most ``--max-connections`` served at once
  (one thread each; more are answered 503 at once), a connection that owes its request for
  ``--idle-timeout-s`` is closed, a body claimed over ``--max-body-mb`` is answered 413 unread.

Test hook: ``RELAX_TEST_ENGINE_BAD_OUTPUT=KIND:N[:CLAIM]`` spoils the engine's first ``N`` generate answers
that have something to spoil (tokens, not aborted; log-probs for the log-prob kinds), one way
(:data:`BAD_OUTPUTS`): ``nan_logprobs``, ``positive_logprobs`` or ``no_logprobs`` (the first token's log-prob
NaN, +0.5, or none at all), ``token_past_vocab`` (the first token id = ``vocab_size``), ``empty_output`` (no
tokens, finish reason kept), ``wrong_count`` (``completion_tokens`` one more). With ``CLAIM`` (a file path) only
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

from relax_hpc.engines.http import API_KEY_ENV, EngineServer, HTTPError, advertised_host, ok, read_api_key, route_handler
from relax_hpc.engines.http_server import IDLE_S, MAX_BODY, MAX_CONNECTIONS
from relax_hpc.engines.model_runner import CPUEngine
from relax_hpc.engines.receiver import weight_routes

log = logging.getLogger("relax_hpc.cpu_engine")


def engine_handler(engine: CPUEngine, api_key: str | None = None):

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
    api_key = read_api_key(a.api_key_file)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cpu_engine %(levelname)s %(message)s")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    engine = CPUEngine(a.model, a.dtype, a.max_batch_size, a.batch_wait_ms, a.seed, a.weight_version,
                       a.served_model_name)
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


if __name__ == "__main__":
    sys.exit(main())
