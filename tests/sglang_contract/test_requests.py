"""Every request relax_hpc's client sends an SGLang engine, sent by :class:`relax_hpc.engines.client.EngineClient`
itself over a real socket to SGLang's own HTTP application (its routes, its request classes, its ``/generate`` schema
gate, its API-key middleware), the engine side replaced by a recorder (sglang_side/recorder_server.py). A wrong type
or a missing required field is refused by SGLang (HTTP 400, the client raises); a key SGLang's class has no field for
is dropped silently by SGLang, so the recorder lists it and :func:`parsed` refuses it."""

from __future__ import annotations

import base64

import httpx
import pytest

from relax_hpc.engines.client import EngineClient, EngineError, SamplingParams, update_protocol

IO = "sglang.srt.managers.io_struct."


def parsed(entries: list[dict], route: str, cls: str, key: str) -> dict:
    """The one recorded request to ``route``: SGLang parsed it into ``io_struct.cls``, every key of its body is a
    field of that class, and it carried the run's key."""
    got = [e for e in entries if e["route"] == route]
    assert len(got) == 1, f"{route}: {len(got)} requests reached SGLang's engine side: {entries}"
    e = got[0]
    assert e["cls"] == IO + cls, f"{route} was parsed into {e['cls']}, not {IO + cls}"
    assert not e["unknown"], (f"{route}: SGLang's {cls} has no field {e['unknown']} (SGLang drops it silently): "
                              f"body {e['body']}")
    assert e["auth"] == f"Bearer {key}", f"{route} went without the run's key: {e['auth']!r}"
    return e["body"]


@pytest.fixture
def client(recorder):
    recorder.take()
    c = EngineClient(recorder.url, api_key=recorder.api_key, retries=0)
    yield c
    c.close()


def test_generate_requests(client, recorder):
    """/generate: one prompt (sampling params, log-probs, rid, seed, stop ids, images, routed experts), a group in
    SGLang's batch form, and a scoring request (input log-probs from logprob_start_len, top-k); the answer read back."""
    png = base64.b64encode(b"\x89PNG not decoded by the recorder").decode()
    sp = SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=[7], sampling_seed=11)
    g = client.generate([1, 2, 3], sp, rid="r-1", image_data=[png], extra={"return_routed_experts": True})
    body = parsed(recorder.take(), "/generate", "GenerateReqInput", recorder.api_key)
    assert body["return_routed_experts"] is True and body["image_data"] == [png] and body["rid"] == "r-1"
    assert len(g.output_ids) == 3 and g.finish_reason.type == "length" and g.weight_version == "0"
    assert len(g.output_logprobs) == 3 and g.meta_info.get("routed_experts")
    import asyncio

    gens = asyncio.run(client.agenerate_group([[1, 2], [3, 4, 5]], [SamplingParams(max_new_tokens=2)] * 2))
    parsed(recorder.take(), "/generate", "GenerateReqInput", recorder.api_key)
    assert [len(x.output_ids) for x in gens] == [2, 2]
    scores = client.input_logprobs([[1, 2, 3, 4]], 1, top_logprobs_num=0)
    body = parsed(recorder.take(), "/generate", "GenerateReqInput", recorder.api_key)
    assert body["logprob_start_len"] == [1] and scores[0].token_ids == [2, 3, 4] and scores[0].problem is None


def test_control_requests(client, recorder):
    """pause (each mode), continue, abort (one rid and all), flush_cache."""
    for mode in ("abort", "retract", "in_place"):
        client.pause_generation(mode)
        assert parsed(recorder.take(), "/pause_generation", "PauseGenerationReqInput", recorder.api_key)["mode"] == mode
    client.continue_generation()
    parsed(recorder.take(), "/continue_generation", "ContinueGenerationReqInput", recorder.api_key)
    client.abort_request("r-1")
    assert parsed(recorder.take(), "/abort_request", "AbortReq", recorder.api_key)["rid"] == "r-1"
    client.abort_request(abort_all=True)
    assert parsed(recorder.take(), "/abort_request", "AbortReq", recorder.api_key)["abort_all"] is True
    assert "Cache flushed" in client.flush_cache()
    assert [e["route"] for e in recorder.take()] == ["/flush_cache"]


def test_weight_update_requests(client, recorder):
    """The weight-update calls as relax_hpc's weight sync sends them, each parsed by SGLang's class for its route."""
    k = recorder.api_key
    client.init_weights_update_group("10.0.0.1", 29500, 1, 3, group_name="wg")
    assert parsed(recorder.take(), "/init_weights_update_group", "InitWeightsUpdateGroupReqInput", k)["world_size"] == 3
    client.begin_weight_update()
    parsed(recorder.take(), "/begin_weight_update", "BeginWeightUpdateReqInput", k)
    client.update_weights_from_distributed(["a.weight", "b.bias"], ["torch.bfloat16", "float32"], [[2, 3], [3]],
                                           group_name="wg", weight_version="4", load_format="flattened_bucket")
    body = parsed(recorder.take(), "/update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput", k)
    assert body["dtypes"] == ["bfloat16", "float32"] and body["load_format"] == "flattened_bucket"
    client.update_weights_from_tensor(["AAAA", "AAAA"], weight_version="5")
    parsed(recorder.take(), "/update_weights_from_tensor", "UpdateWeightsFromTensorReqInput", k)
    client.end_weight_update()
    parsed(recorder.take(), "/end_weight_update", "EndWeightUpdateReqInput", k)
    client.update_weights_from_disk("/ckpt/hf-step-4", weight_version="6")
    parsed(recorder.take(), "/update_weights_from_disk", "UpdateWeightFromDiskReqInput", k)
    client.update_weight_version("7")
    parsed(recorder.take(), "/update_weight_version", "UpdateWeightVersionReqInput", k)
    assert client.weight_version() == "7"  # /model_info, as SGLang's route writes it
    assert client.get_weights_by_name("a.weight", truncate_size=2) == [[0.0, 0.0]]
    parsed(recorder.take(), "/get_weights_by_name", "GetWeightsByNameReqInput", k)
    client.destroy_weights_update_group("wg")
    parsed(recorder.take(), "/destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput", k)


def test_memory_requests(client, recorder):
    """release/resume memory occupation: all tags (null) and named ones; SGLang answers a JSON null."""
    k = recorder.api_key
    assert client.release_memory_occupation() == {}
    assert parsed(recorder.take(), "/release_memory_occupation", "ReleaseMemoryOccupationReqInput", k)["tags"] is None
    assert client.resume_memory_occupation(["weights", "kv_cache"]) == {}
    body = parsed(recorder.take(), "/resume_memory_occupation", "ResumeMemoryOccupationReqInput", k)
    assert body["tags"] == ["weights", "kv_cache"]


def test_info_requests(client, recorder):
    """server_info (SGLang's build_server_info: its version picks the update protocol), model_info, health_generate
    (SGLang's route runs its 1-token generation through the engine side)."""
    info = client.server_info()
    assert info["version"] == "0.5.23" and update_protocol(info["version"]) == "session"
    assert "internal_states" in info and info["weight_version"] == "0"
    assert client.model_info()["weight_version"] is not None
    client.health_generate(timeout=30)
    assert client.is_healthy(timeout=30)


ROUTES = ["/generate", "/pause_generation", "/continue_generation", "/abort_request", "/flush_cache",
          "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
          "/update_weights_from_tensor", "/update_weights_from_disk", "/begin_weight_update", "/end_weight_update",
          "/update_weight_version", "/release_memory_occupation", "/resume_memory_occupation",
          "/get_weights_by_name", "/server_info", "/model_info"]


def test_auth_refuses_requests_without_the_key(client, recorder):
    """SGLang's own auth middleware (the key from its ServerArgs) refuses each route relax_hpc calls without the
    Authorization header, and with a wrong key; the client's calls above carried it. /health_generate is open by
    SGLang's design (probes)."""
    for path in ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request("GET" if path in ("/server_info", "/model_info") else "POST", recorder.url + path,
                              json={}, headers=headers, timeout=30)
            assert r.status_code == 401, f"{path} without the key: HTTP {r.status_code}"
    assert recorder.take() == []  # nothing reached the engine side
    with pytest.raises(EngineError, match="401"):
        EngineClient(recorder.url, retries=0).server_info()


def test_negative_controls(client, recorder):
    """The checks above can fail: a misspelled field (SGLang drops it silently, the recorder names it), a wrong type
    and a missing required field (SGLang refuses: HTTP 400), an unknown sampling key (SGLang's schema gate)."""
    client.request("POST", "/pause_generation", {"mdoe": "abort"})
    with pytest.raises(AssertionError, match="has no field \\['mdoe'\\]"):
        parsed(recorder.take(), "/pause_generation", "PauseGenerationReqInput", recorder.api_key)
    with pytest.raises(EngineError, match="HTTP 400"):
        client.request("POST", "/init_weights_update_group", {"master_address": "h", "master_port": "not a port",
                                                               "rank_offset": 1, "world_size": 2})
    with pytest.raises(EngineError, match="HTTP 400"):
        client.request("POST", "/update_weight_version", {})
    with pytest.raises(EngineError, match="unknown field `max_new_tokns`"):
        client.generate([1, 2], {"max_new_tokns": 2})
    assert recorder.take() == []
