"""SGLang's own HTTP application (``sglang.srt.entrypoints.http_server.app``), served by uvicorn on a real port, with
its engine side (the tokenizer manager) replaced by a recorder. Every request goes through SGLang's real route
parsing (FastAPI into SGLang's ``io_struct`` request classes, ``/generate``'s schema gate) and, with ``--api-key``,
SGLang's own auth middleware. Run by SGLang's interpreter:

    python recorder_server.py --record FILE --ready FILE [--api-key KEY]

Each request that reaches the engine side is one JSON line in FILE: the route, the SGLang class it was parsed into,
the raw JSON body, and the body's keys that the class has no field for (SGLang's parse drops them silently: the
tests refuse them). Requests SGLang refused never reach the recorder; the client sees SGLang's own status."""

import argparse
import asyncio
import contextvars
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import boot  # noqa: E402,F401 - before sglang

import torch  # noqa: E402
import pybase64  # noqa: E402
import uvicorn  # noqa: E402

from sglang.api.v1.api_types import FinishLength, GenerateMetaInfo, GenerateResponse, LogprobEntry  # noqa: E402
from sglang.srt.entrypoints import http_server as hs  # noqa: E402
from sglang.srt.managers.tokenizer_manager import ServerStatus  # noqa: E402
from sglang.srt.runtime_context import publish  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from sglang.srt.utils.auth import add_api_key_middleware  # noqa: E402

HEALTH = hs.HEALTH_CHECK_RID_PREFIX
_CURRENT = contextvars.ContextVar("current", default={})


class _NoBody:
    """/flush_cache takes no body (a query parameter only)."""
LAYERS, TOP_K = 2, 2  # the recorder's routed experts: [tokens, LAYERS, TOP_K]


class KeepBody:
    """ASGI middleware: keeps the request's raw body and Authorization header for the recorder (the route handler
    runs in the same task, so it sees them through the context variable)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        seen = {"path": scope.get("path"), "auth": (headers.get(b"authorization") or b"").decode() or None,
                "chunks": []}
        _CURRENT.set(seen)

        async def recv():
            msg = await receive()
            if msg["type"] == "http.request":
                seen["chunks"].append(msg.get("body", b""))
            return msg

        await self.app(scope, recv, send)


def field_names(cls):
    """The JSON keys SGLang's request class ``cls`` has a field for (a msgspec Struct or a dataclass), or None."""
    if hasattr(cls, "__struct_fields__"):
        return set(cls.__struct_fields__)
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return None


class Recorder:
    """The tokenizer manager's surface that SGLang's routes call, answering as SGLang's manager answers."""

    def __init__(self, server_args, record):
        self.server_args, self.record_path = server_args, record
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name
        self.gracefully_exit = False
        self.server_status = ServerStatus.Up
        self.is_generation = True
        self.last_receive_tstamp = 0.0
        self.rid_to_state = {}
        self.startup_time = time.time()
        self.weight_version = server_args.weight_version
        self.model_config = type("ModelConfig", (), {"is_image_understandable_model": False,
                                                     "is_audio_understandable_model": False,
                                                     "hf_config": type("HF", (), {"model_type": "qwen3",
                                                                                   "architectures": ["Qwen3"]})()})()

    def config_value(self, name):
        return self.weight_version if name == "weight_version" else getattr(self.server_args, name, None)

    def _record(self, route, obj, request=None):
        seen = _CURRENT.get()
        path, auth = seen.get("path"), seen.get("auth")
        raw = b"".join(seen.get("chunks", ()))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        cls = type(obj)
        names = field_names(cls)
        unknown = sorted(set(body) - names) if isinstance(body, dict) and names is not None else []
        with open(self.record_path, "a") as f:
            f.write(json.dumps({"route": route, "path": path, "cls": f"{cls.__module__}.{cls.__qualname__}",
                                "body": body, "unknown": unknown, "auth": auth}, default=repr) + "\n")

    # ---- generation
    async def generate_request(self, obj, request=None):
        if isinstance(obj.rid, str) and obj.rid.startswith(HEALTH):
            self.last_receive_tstamp = time.time()
            yield {}
            return
        self._record("/generate", obj, request)
        obj.normalize_batch_and_arguments()
        n = 1 if obj.is_single else obj.batch_size
        outs = [self._answer(obj if obj.is_single else obj[i]) for i in range(n)]
        yield outs[0] if obj.is_single else outs

    def _answer(self, one):
        ids = list(one.input_ids)
        sp = one.sampling_params or {}
        k = int(sp.get("max_new_tokens") or 0)
        out = [(ids[-1] + j + 1) % 50 for j in range(k)]
        lps = [LogprobEntry(logprob=-0.5, token_id=t) for t in out] if one.return_logprob else None
        start = one.logprob_start_len if isinstance(one.logprob_start_len, int) and one.logprob_start_len >= 0 else 0
        inlps = ([LogprobEntry(logprob=None if j == 0 else -1.0, token_id=t) for j, t in enumerate(ids[start:])]
                 if one.return_logprob else None)
        meta = GenerateMetaInfo(id=str(one.rid), prompt_tokens=len(ids), completion_tokens=len(out),
                                finish_reason=FinishLength(length=k), output_token_logprobs=lps,
                                input_token_logprobs=inlps, weight_version=self.weight_version)
        d = GenerateResponse(text="", meta_info=meta, output_ids=out).to_json_value()
        if one.return_routed_experts:  # as SGLang's tokenizer manager encodes a tensor of them
            n = len(ids) + len(out) - 1
            val = torch.arange(n * LAYERS * TOP_K, dtype=torch.int32).reshape(n, LAYERS, TOP_K) % 4
            d["meta_info"]["routed_experts"] = pybase64.b64encode(val.numpy().tobytes()).decode("utf-8")
        return d

    def create_abort_task(self, obj):
        return None

    def abort_request(self, rid="", abort_all=False):
        if _CURRENT.get().get("path") == "/abort_request":  # the route passes the fields of its parsed AbortReq
            from sglang.srt.managers.io_struct import AbortReq
            self._record("/abort_request", AbortReq(rid=rid, abort_all=abort_all))

    # ---- control, info
    async def flush_cache(self, timeout_s=0.0):
        self._record("/flush_cache", _NoBody())
        from sglang.srt.managers.io_struct import FlushCacheReqOutput
        return FlushCacheReqOutput(success=True)

    async def get_internal_state(self):
        return [{"weight_version": self.weight_version}]

    async def pause_generation(self, obj):
        self._record("/pause_generation", obj)

    async def continue_generation(self, obj):
        self._record("/continue_generation", obj)

    async def update_weight_version(self, obj):
        self._record("/update_weight_version", obj)
        self.weight_version = obj.new_version


def _simple(route):
    async def call(self, obj, request=None):
        self._record(route, obj, request)
        if route == "/get_weights_by_name":
            return [[0.0] * 2]
        if route in ("/release_memory_occupation", "/resume_memory_occupation"):
            return None
        if route == "/update_weights_from_disk":
            return True, "ok", 0
        v = getattr(obj, "weight_version", None)
        if v is not None:
            self.weight_version = v
        return True, "ok"
    return call


for _r in ("init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed",
           "update_weights_from_tensor", "update_weights_from_disk", "begin_weight_update", "end_weight_update",
           "release_memory_occupation", "resume_memory_occupation", "get_weights_by_name"):
    setattr(Recorder, _r, _simple("/" + _r))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--record", required=True)
    p.add_argument("--ready", required=True)
    p.add_argument("--api-key", default=None)
    a = p.parse_args()
    model = os.path.join(os.path.dirname(os.path.abspath(a.record)), "model")  # a local path: no hub look-up
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:  # what SGLang's argument resolution reads of a model
        json.dump({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 16,
                   "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
                   "vocab_size": 64, "max_position_embeddings": 128, "torch_dtype": "float32"}, f)
    argv = ["--model-path", model, "--weight-version", "0", "--skip-server-warmup", "--device", "cpu"]
    if a.api_key:
        argv += ["--api-key", a.api_key]
    server_args = prepare_server_args(argv)
    publish(server_args, role="tokenizer")
    tm = Recorder(server_args, a.record)
    hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={}))

    app = hs.app

    app.add_middleware(KeepBody)
    if a.api_key:  # SGLang's own auth middleware, as _setup_and_run_http_server adds it
        add_api_key_middleware(app, api_key=server_args.api_key, admin_api_key=server_args.admin_api_key)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)

    async def run():
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        with open(a.ready + ".tmp", "w") as f:
            f.write(f"http://127.0.0.1:{port}")
        os.replace(a.ready + ".tmp", a.ready)
        await task

    asyncio.run(run())


if __name__ == "__main__":
    main()
