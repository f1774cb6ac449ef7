"""The reference engine's side of a one-GPU loop, on the CPU: what it serves (``/server_info``), a weight-sync
backend it does not serve refused at once, the memory hand-over's states, ``/update_weights_from_tensor`` from this
process into the engine process through shared memory (and a pickle that is not a tensor list refused unrun), and
the engine's log of control calls."""

from __future__ import annotations

import base64
import os
import pickle
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from relax_hpc.engines.client import EngineError
from relax_hpc.engines.tensor_wire import deserialize_named, serialize_named

PROMPT = [1, 10, 11, 12]


def calls(log_path) -> list[str]:
    """The calls the engine logged, in order (docs/engines.md: one ``call /path`` line each)."""
    return re.findall(r"call (/\w+)", Path(log_path).read_text())


def post(url: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body or {}, timeout=60)


def wait_for(cond, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def perturbed(tiny_llama, names: list[str], seed: int) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    sd = {k: v for f in sorted(Path(tiny_llama).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    gen = torch.Generator().manual_seed(seed)
    return [(n, sd[n].float() + 0.25 * torch.randn(sd[n].shape, generator=gen)) for n in names]


def test_server_info_says_what_it_serves(client):
    info = client.server_info()
    assert info["weight_sync_backends"] == ["gloo"] and info["device"] == "cpu" and info["gpu_uuids"] == []
    assert info["weight_update_paths"] == ["distributed", "tensor", "disk"]
    assert info["hostname"] == socket.gethostname() and info["memory_released"] is False
    assert info["dtype"] == "float32"  # --dtype auto on the CPU


GROUP = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g"}


def test_a_backend_not_served_is_refused_at_once(cpu_engine, client, tiny_llama):
    """No rendezvous is tried (nothing listens at the master port): the answer comes at once, naming both sides."""
    t0 = time.monotonic()
    with pytest.raises(EngineError) as e:
        client.init_weights_update_group("127.0.0.1", 1, 1, 2, group_name="g", backend="nccl", timeout=30)
    assert e.value.status == 400 and "this engine serves gloo; the sender asked nccl" in str(e.value), str(e.value)
    r = post(cpu_engine.url, "/init_weights_update_group", GROUP)  # no backend: SGLang's default, nccl
    assert r.status_code == 400 and r.json()["success"] is False and "the sender asked nccl" in r.json()["message"]
    assert time.monotonic() - t0 < 10
    # the reverse: an engine serving nccl only (--weight-sync-backends nccl; here in-process) refuses gloo
    from relax_hpc.engines.cpu_engine import CPUEngine
    from relax_hpc.engines.receiver import weight_routes

    only_nccl = CPUEngine(str(tiny_llama), max_batch=2, batch_wait_ms=1.0, seed=0, weight_sync_backends=["nccl"])
    assert only_nccl.sync_info()["weight_sync_backends"] == ["nccl"]
    status, answer = weight_routes(only_nccl)["/init_weights_update_group"]({**GROUP, "backend": "gloo"})
    assert status == 400 and answer["success"] is False
    assert "this engine serves nccl; the sender asked gloo" in answer["message"], answer
    assert not only_nccl.groups


def test_release_and_resume_states(cpu_engine, client, tiny_llama):
    url = cpu_engine.url
    assert post(url, "/resume_memory_occupation").status_code == 400  # nothing released
    r = post(url, "/release_memory_occupation", {"tags": None})
    assert r.status_code == 200 and r.json() is None  # SGLang's answer: 200, a JSON null
    assert client.server_info()["memory_released"] is True
    g = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert g.status_code == 400 and "/resume_memory_occupation" in g.json()["error"]["message"]
    for path in ("/health", "/health_generate"):  # alive, though nothing can run
        assert httpx.get(url + path, timeout=10).status_code == 200
    assert client.is_healthy()
    again = post(url, "/release_memory_occupation", {"tags": ["weights"]})
    assert again.status_code == 400 and "already released" in again.json()["error"]["message"]
    client.begin_weight_update()
    try:
        with pytest.raises(EngineError, match="resume first"):
            client.update_weights_from_tensor([serialize_named(perturbed(tiny_llama, ["model.norm.weight"], 0))])
    finally:
        client.end_weight_update()
    with pytest.raises(EngineError, match="resume first"):
        client.update_weights_from_disk(str(tiny_llama))
    assert client.resume_memory_occupation(["weights"]) == {}
    still = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert still.status_code == 400, "kv_cache and cuda_graph are still released"
    client.update_weights_from_disk(str(tiny_llama), weight_version="disk")  # weights resumed: updates go in
    assert client.resume_memory_occupation() == {}  # null: every tag still released
    assert client.server_info()["memory_released"] is False
    with pytest.raises(EngineError, match="not released"):
        client.resume_memory_occupation()
    bad = post(url, "/release_memory_occupation", {"tags": ["weights", "optimizer"]})
    assert bad.status_code == 400 and "optimizer" in bad.text
    assert len(client.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True}).output_ids) == 2


def test_release_is_refused_while_requests_wait(cpu_engine, client):
    client.pause_generation("retract")
    out: dict = {}
    sp = {"max_new_tokens": 2, "ignore_eos": True}
    t = threading.Thread(target=lambda: out.update(g=client.generate(PROMPT, sp)))
    t.start()
    try:
        wait_for(lambda: client.server_info()["internal_states"][0]["num_waiting_reqs"] == 1, what="a waiting request")
        with pytest.raises(EngineError, match=r"no ongoing request.*#queue-req: 1") as e:
            client.release_memory_occupation()
        assert e.value.status == 400 and client.server_info()["memory_released"] is False
    finally:
        client.continue_generation()
        t.join(60)
    assert len(out["g"].output_ids) == 2


def test_update_weights_from_tensor_through_shared_memory(client, tiny_llama):
    names = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"]
    named = perturbed(tiny_llama, names, seed=3)
    flat = torch.cat([t.flatten() for _, t in named])  # as a sender's bucket: views into one flat buffer
    views, off = [], 0
    for n, t in named:
        views.append((n, flat[off:off + t.numel()].view(t.shape)))
        off += t.numel()
    with pytest.raises(EngineError, match="begin_weight_update"):  # the session rule of SGLang 0.5.23
        client.update_weights_from_tensor([serialize_named(views)])
    client.begin_weight_update()
    try:  # an entry is opened once (its shared memory is then the engine's to drop): a fresh one per call
        d = client.update_weights_from_tensor([serialize_named(views)], load_format="direct", weight_version="t1")
    finally:
        client.end_weight_update()
    assert d["success"] is True and client.weight_version() == "t1"
    for n, t in named:
        assert torch.equal(torch.tensor(client.get_weights_by_name(n, truncate_size=4)), t[:4]), n
    assert client.generate(PROMPT, {"max_new_tokens": 1}).weight_version == "t1"


def test_update_weights_from_tensor_refusals(cpu_engine, client, tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    evil = base64.b64encode(pickle.dumps([("model.norm.weight", Evil())])).decode()
    one = serialize_named([("model.norm.weight", torch.ones(64))])
    client.begin_weight_update()
    try:
        with pytest.raises(EngineError, match=r"refused to unpickle global (posix|os)\.system") as e:
            client.update_weights_from_tensor([evil])
        assert e.value.status == 400 and not marker.exists()
        with pytest.raises(EngineError, match="send load_format null or 'direct'"):
            client.update_weights_from_tensor([one], load_format="flattened_bucket")
        with pytest.raises(EngineError, match="one per TP rank"):
            client.update_weights_from_tensor([one, one])
        with pytest.raises(EngineError, match="not base64"):
            client.update_weights_from_tensor(["not base64 !"])
        with pytest.raises(EngineError, match="unknown parameter"):
            client.update_weights_from_tensor([serialize_named([("model.nope", torch.ones(2))])])
    finally:
        client.end_weight_update()
    assert not marker.exists()


def test_control_calls_are_logged_in_order(cpu_engine, client, tiny_llama):
    before = len(calls(cpu_engine.log_path))
    client.pause_generation("abort")
    client.flush_cache()
    client.release_memory_occupation()
    client.resume_memory_occupation()
    client.begin_weight_update()
    client.update_weights_from_tensor([serialize_named(perturbed(tiny_llama, ["model.norm.weight"], 5))])
    client.update_weight_version("v9")
    client.end_weight_update()
    client.continue_generation()
    client.generate(PROMPT, {"max_new_tokens": 1})
    client.health_generate()  # not a control call: not logged
    wait_for(lambda: len(calls(cpu_engine.log_path)) >= before + 10, what="the log lines")
    assert calls(cpu_engine.log_path)[before:] == [
        "/pause_generation", "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
        "/begin_weight_update", "/update_weights_from_tensor", "/update_weight_version", "/end_weight_update",
        "/continue_generation", "/generate"]
    text = Path(cpu_engine.log_path).read_text()
    assert "call /release_memory_occupation tags=None" in text and "call /pause_generation mode=abort" in text
    assert "call /update_weight_version new_version=v9" in text


def test_tensor_wire_round_trip_and_what_it_refuses(tmp_path):
    """In this process (the shared blocks come from torch's cache): names, values, views and dtypes come back; a
    pickle naming any other global, or that is not a (name, tensor) list, is a ValueError and runs nothing."""
    flat = torch.arange(10, dtype=torch.float32)
    named = [("a", flat[2:8].view(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16)), ("c", torch.zeros(0))]
    back = deserialize_named(serialize_named(named))
    assert [n for n, _ in back] == ["a", "b", "c"]
    assert all(torch.equal(x, y) and x.dtype == y.dtype for (_, x), (_, y) in zip(named, back))
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    with pytest.raises(ValueError, match=r"global (posix|os)\.system"):
        deserialize_named(pickle.dumps([("x", Evil())]))
    with pytest.raises(ValueError, match=r"global builtins\.eval"):
        deserialize_named(pickle.dumps(eval))
    with pytest.raises(ValueError, match="not a list of \\(name, tensor\\) pairs"):
        deserialize_named(base64.b64encode(pickle.dumps({"a": 1})).decode())
    assert not marker.exists()


def test_released_weights_come_back_in_shape_and_take_an_update(tiny_llama):
    """The freeing path of a GPU engine, run on the CPU (in-process, ``frees_memory`` on): each parameter's
    storage is emptied on release (tied ones once), the shapes come back on resume, and an update then serves
    exactly what the untouched engine served."""
    from relax_hpc.engines.cpu_engine import CPUEngine
    from relax_hpc.engines.scheduler import Req

    def greedy(engine) -> list[int]:
        from relax_hpc.engines.model_runner import _check_sampling

        r = Req("r", PROMPT, _check_sampling({"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}), True,
                torch.Generator().manual_seed(0))
        engine.scheduler.submit([r])
        r.done.wait(60)
        return r.output_ids

    engine = CPUEngine(str(tiny_llama), max_batch=2, batch_wait_ms=1.0, seed=0)
    engine.frees_memory = True
    want = greedy(engine)
    shapes = {n: tuple(p.shape) for n, p in engine.params.items()}
    engine.release_memory_occupation({"tags": None})
    assert all(p.numel() == 0 for p in engine.model.parameters())
    assert engine.params["model.norm.weight"].numel() == 0  # the receiver's names point at the same parameters
    assert engine.health_generate()
    engine.resume_memory_occupation({"tags": None})
    assert {n: tuple(p.shape) for n, p in engine.params.items()} == shapes
    ok, message = engine.update_weights_from_disk({"model_path": str(tiny_llama)})
    assert ok, message
    assert greedy(engine) == want
