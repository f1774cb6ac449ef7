"""The weight-sync group agrees on its backend, and engines that share the actor's GPU hand it over.

- :func:`agree_backend` and the sender's path choice: a group that cannot form is refused at connect, naming the
  engine, the backend each side asked for and the fix, before anything waits (real CPU engines, one of them
  answering as an engine that serves NCCL only).
- The tensor path (``/update_weights_from_tensor``) to a real engine process, through shared memory on CPU.
- :class:`ActorSync` with ``offload``: release before training, resume before the push, read back from the
  engine's own log of calls.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relax_hpc.engines.client import EngineClient, EngineError
from relax_hpc.weights import ActorSync, engine_fingerprint, fingerprint
from relax_hpc.weights import sync as S
from relax_hpc.weights.sync import WeightSender, WeightSyncRefused, agree_backend

from .hf_export import HFModel
from .conftest import ENGINE_ARGS, perturb

N_ENGINES = 1
GLOO, NCCL = {"weight_sync_backends": ["gloo"]}, {"weight_sync_backends": ["nccl"]}


def test_agree_backend_picks_one_every_member_serves_or_names_each_side():
    both = {"weight_sync_backends": ["nccl", "gloo"]}
    assert agree_backend(None, {"a": both, "b": both}, cuda=True) == "nccl"
    assert agree_backend(None, {"a": both, "b": GLOO}, cuda=True) == "gloo"  # a GPU actor sends from host memory
    assert agree_backend(None, {"a": both}, cuda=False) == "gloo"
    assert agree_backend(None, {"a": both}, cuda=True, shared_gpu=["a"]) == "gloo"  # NCCL: no two ranks on one GPU
    assert agree_backend(None, {"a": {}}, cuda=True) == "nccl"  # SGLang says nothing: it serves NCCL
    with pytest.raises(WeightSyncRefused) as e:  # a sender that asks NCCL and a member that serves only gloo
        agree_backend("nccl", {"http://e1": both, "http://e2": GLOO}, cuda=True)
    msg = str(e.value)
    assert "asked for nccl" in msg and "engine http://e2 serves gloo" in msg and "Fix:" in msg, msg
    assert e.value.engines == ["http://e2"] and not e.value.restartable
    with pytest.raises(WeightSyncRefused) as e:  # the reverse: a CPU actor (gloo) and an SGLang engine (NCCL only)
        agree_backend(None, {"http://sg": {}}, cuda=False)
    msg = str(e.value)
    assert "no GPU" in msg and "http://sg serves nccl" in msg and "rollout.engine.kind: reference" in msg, msg


def test_the_path_follows_the_gpus_the_engines_share(monkeypatch):
    """Which GPU a process is on cannot exist on this machine: the choice is checked with the UUIDs given."""
    monkeypatch.setattr(S, "my_gpu", lambda: "GPU-0")
    monkeypatch.setattr(S.torch.cuda, "is_available", lambda: True)
    here = {"weight_sync_backends": ["nccl", "gloo"], "weight_update_paths": ["distributed", "tensor"],
            "gpu_uuids": ["GPU-0"], "hostname": S.socket.gethostname()}
    other = dict(here, gpu_uuids=["GPU-1"])
    s = WeightSender(device="cpu")
    s._choose({"http://a": here})
    assert (s.path, s.backend) == ("tensor", None)
    s = WeightSender(device="cpu")
    s._choose({"http://b": other})
    assert (s.path, s.backend) == ("distributed", "nccl")
    s = WeightSender(device="cpu", path="distributed")  # offload: false on a shared GPU: a group, but not NCCL
    s._choose({"http://a": here})
    assert (s.path, s.backend) == ("distributed", "gloo")
    with pytest.raises(WeightSyncRefused, match=r"http://a share this actor's GPU and http://b do not"):
        WeightSender(device="cpu")._choose({"http://a": here, "http://b": other})
    with pytest.raises(WeightSyncRefused, match=r"http://c runs on elsewhere"):
        WeightSender(device="cpu", path="tensor")._choose({"http://c": dict(here, hostname="elsewhere")})
    with pytest.raises(WeightSyncRefused, match=r"http://d does not serve /update_weights_from_tensor"):
        WeightSender(device="cpu", path="tensor")._choose({"http://d": dict(here, weight_update_paths=["distributed"])})


@pytest.fixture(scope="module")
def nccl_only(tiny_model, tmp_path_factory):
    """An engine that answers as one serving NCCL only (as SGLang does)."""
    from relax_hpc.engines.launcher import start_engine

    h = start_engine("reference", tiny_model, log_path=tmp_path_factory.mktemp("nccl-only") / "engine.log",
                     extra_args=[*ENGINE_ARGS, "--weight-sync-backends", "nccl"])
    try:
        yield h.wait_ready(180)
    finally:
        h.stop()


def test_a_group_that_cannot_form_is_refused_at_connect(engines, nccl_only):
    url = engines[0].url
    with pytest.raises(WeightSyncRefused) as e:  # asks NCCL; the engine serves gloo (a CPU engine)
        WeightSender(backend="nccl", device="cpu").connect([url], "127.0.0.1")
    assert f"engine {url} serves gloo" in str(e.value) and "asked for nccl" in str(e.value), str(e.value)
    with pytest.raises(WeightSyncRefused) as e:  # the reverse: this CPU process can only send gloo
        WeightSender().connect([nccl_only.url], "127.0.0.1")
    assert f"engine {nccl_only.url} serves nccl" in str(e.value) and "no GPU" in str(e.value), str(e.value)
    # the engine refuses such a group by itself too, at once, naming both sides
    with pytest.raises(EngineError, match=r"serves gloo.*asked nccl"):
        EngineClient(url).init_weights_update_group("127.0.0.1", 1, 1, 2, group_name="g", backend="nccl", timeout=5)
    s = WeightSender()  # auto on CPU: gloo, which the engine serves
    s.connect([url], "127.0.0.1")
    assert (s.path, s.backend) == ("distributed", "gloo")
    s.close()


def calls(log_path) -> list[str]:
    """The control calls an engine logged, in order (docs/engines.md: one ``call /path`` line each)."""
    return re.findall(r"INFO call (/\w+)", Path(log_path).read_text())


def test_the_tensor_path_lands_through_shared_memory(engines, hf_model):
    url = engines[0].url
    named = perturb(hf_model, seed=7)
    s = WeightSender(path="tensor", bucket_bytes=64 << 10)
    s.connect([url], "127.0.0.1")
    before = len(calls(engines[0].log_path))
    m = s.push(named.items(), version="t1")
    c = EngineClient(url)
    assert engine_fingerprint(c, list(named)) == fingerprint(named) and c.weight_version() == "t1"
    assert m["perf/weight_sync_tensors"] == len(named) and m["perf/weight_sync_buckets"] > 1, m
    assert calls(engines[0].log_path)[before:] == [
        "/pause_generation", "/flush_cache", "/begin_weight_update",
        *["/update_weights_from_tensor"] * int(m["perf/weight_sync_buckets"]),
        "/update_weight_version", "/end_weight_update", "/continue_generation"]
    s.close()
    c.close()



def test_offload_releases_before_training_and_resumes_before_the_push(engines, hf_model, world):
    url, log = engines[0].url, engines[0].log_path
    sync = ActorSync(0, None, None, address=lambda: "127.0.0.1", offload=True)
    sync.connect({"engine0": url}, {})
    assert sync.hands_over and sync.sender.path == "tensor"
    c = EngineClient(url)
    before = len(calls(log))
    released = sync.release()  # the actor is about to train
    assert set(released) == {"perf/engine_release_time"} and c.server_info()["memory_released"] is True
    assert sync.release() == {}, "released once per step"
    with pytest.raises(EngineError, match="resume_memory_occupation"):
        c.generate([1, 2, 3], {"max_new_tokens": 1})  # nothing generates on memory handed over
    assert c.is_healthy(), "an engine that handed its memory over is alive"
    perturb(hf_model, seed=11)
    done = sync.sync("1", None, HFModel(hf_model), progress=lambda: None, check=True)
    assert "perf/engine_resume_time" in done.metrics and done.metrics["weights/fingerprint_match"] == 1.0
    assert c.server_info()["memory_released"] is False and c.weight_version() == "1"
    order = calls(log)[before:]
    assert [c for c in order if c != "/generate"][:2] == ["/release_memory_occupation", "/resume_memory_occupation"]
    assert order.index("/update_weights_from_tensor") < order.index("/update_weight_version"), order
    g = c.generate([1, 2, 3], {"max_new_tokens": 1})  # the new weights generate
    assert g.weight_version == "1"
    c.release_memory_occupation()  # an engine that cannot release (here: already released) keeps what it has:
    assert "perf/engine_release_time" in sync.release() and sync.released == {}  # training goes on, no resume owed
    sync.close()
    # an actor started again (a restart mid-step) finds the engine released: its first sync resumes it
    again = ActorSync(0, None, None, address=lambda: "127.0.0.1", offload=True)
    again.connect({"engine0": url}, {})
    assert again.released == {"engine0": url}
    done = again.sync("2", None, HFModel(hf_model), progress=lambda: None, check=True)
    assert "perf/engine_resume_time" in done.metrics and c.server_info()["memory_released"] is False
    again.close()
    c.close()
