"""WeightSender against real CPU engine processes: this test process plays the actor's rank 0, holding an HF
copy of the weights; the engines are the CPU engine (SGLang's HTTP API, gloo weight group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from relax_hpc.engines.client import EngineClient, SamplingParams
from relax_hpc.weights import WeightSender, WeightSyncError, engine_fingerprint, fingerprint, load_from_disk
from relax_hpc.threads import daemon_call

from .conftest import perturb, teacher_forced_logprobs

N_ENGINES = 3  # two in the shared group; the third is killed in test_dead_engine_during_push
PROMPT = [1, 10, 11, 12, 13, 14]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)  # outlasts the pause by far
BUCKET = 48 * 1024  # the tiny model's MLP weights (64 KiB) exceed it and go alone; the rest share buckets


@pytest.fixture(scope="module")
def clients(engines):
    cs = [EngineClient(h.url, timeout=60) for h in engines]
    yield cs
    for c in cs:
        c.close()


@pytest.fixture(scope="module")
def sender(clients):
    s = WeightSender(bucket_bytes=BUCKET, timeout=120, connect_timeout=60)
    s.connect(clients[:2], "127.0.0.1")
    yield s
    s.close()


def assert_engine_has(client, sd: dict[str, torch.Tensor]) -> None:
    assert engine_fingerprint(client, list(sd)) == fingerprint(sd), f"engine {client.url} weights differ"


def logprob_gap(client, model, sp=GREEDY):
    g = client.generate(PROMPT, sp)
    ref = teacher_forced_logprobs(model, PROMPT, g.output_ids)
    return g, (ref - torch.tensor(g.output_logprobs)).abs().max().item()


def wait_running(client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while client.server_info()["internal_states"][0]["num_running_reqs"] < 1:
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.01)


def split_point(old_lp: torch.Tensor, new_lp: torch.Tensor, got: torch.Tensor, tol: float = 1e-4) -> int:
    """k such that tokens [:k] carry the old model's log-probs and [k:] the new one's; asserts one exists."""
    k = 0
    while k < len(got) and abs(old_lp[k] - got[k]) < tol:
        k += 1
    bad = [i for i in range(k, len(got)) if abs(new_lp[i] - got[i]) >= tol]
    assert not bad, f"tokens {bad[:5]}… match neither weight version (split at {k}): corrupted generation"
    return k


def test_connect_group_layout(sender, clients):
    assert sender.connected and sender.world_size == 3 and sender.rank_offsets == [1, 2]
    assert sender.master_port and sender.master_port > 0  # chosen by the kernel


def test_push_bucketed_two_engines(sender, clients, hf_model):
    before = [c.generate(PROMPT, GREEDY).output_ids for c in clients[:2]]
    sd = perturb(hf_model, seed=1)
    m = sender.push(sd.items(), version="v1")
    assert m["perf/weight_sync_tensors"] == len(sd)
    assert m["perf/weight_sync_bytes"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert 1 < m["perf/weight_sync_buckets"] < len(sd)
    assert m["perf/weight_sync_time"] >= m["perf/weight_sync_transfer_time"] > 0
    for c, b in zip(clients[:2], before):
        assert_engine_has(c, sd)
        assert c.weight_version() == "v1"
        g, gap = logprob_gap(c, hf_model)
        assert gap < 1e-4 and g.weight_version == "v1" and g.output_ids != b
    # the third engine is not in the group and kept its weights
    assert clients[2].weight_version() == "default"


def test_push_per_tensor_mode(sender, clients, hf_model):
    sd = perturb(hf_model, seed=2)
    m = sender.push(sd.items(), version=2, mode="per_tensor")
    assert m["perf/weight_sync_tensors"] == len(sd)
    for c in clients[:2]:
        assert_engine_has(c, sd)
        assert c.weight_version() == "2"
        assert logprob_gap(c, hf_model)[1] < 1e-4


def test_push_bf16_subset_and_large_bucket(sender, clients, hf_model):
    """A partial update (a few tensors) in another dtype: the engine casts into its fp32 parameters."""
    sd = perturb(hf_model, seed=3)
    part = {n: sd[n].to(torch.bfloat16) for n in ["model.norm.weight", "lm_head.weight", "model.layers.1.mlp.up_proj.weight"]}
    sender.push(part.items(), version="v3-partial", pause_mode="abort")
    for c in clients[:2]:
        assert_engine_has(c, {n: t.float() for n, t in part.items()})


def test_retract_resumes_inflight_generation_on_new_weights(sender, clients, hf_model):
    """pause retract: an in-flight request goes back to the queue and finishes on the new weights; every token
    carries exactly the old or the new model's log-prob (old prefix, new suffix)."""
    c = clients[0]
    old_sd = perturb(hf_model, seed=4)
    sender.push(old_sd.items(), version="r-old")
    fut = daemon_call(c.generate, PROMPT, LONG)
    wait_running(c)
    new_sd = perturb(hf_model, seed=5)
    sender.push(new_sd.items(), version="r-new", pause_mode="retract")
    g = fut.result(timeout=300)
    assert g.finish_reason.type == "length" and len(g.output_ids) == LONG.max_new_tokens
    assert g.weight_version == "r-new"
    new_lp = teacher_forced_logprobs(hf_model, PROMPT, g.output_ids)
    hf_model.load_state_dict(old_sd)
    old_lp = teacher_forced_logprobs(hf_model, PROMPT, g.output_ids)
    k = split_point(old_lp, new_lp, torch.tensor(g.output_logprobs))
    assert 0 < k < len(g.output_ids), f"the sync did not land mid-generation (split {k}); engine too fast?"


def test_abort_returns_inflight_generation_unchanged(sender, clients, hf_model):
    """pause abort: the in-flight request returns at once, aborted, made entirely by the old weights."""
    c = clients[1]
    old_sd = perturb(hf_model, seed=6)
    sender.push(old_sd.items(), version="a-old")
    fut = daemon_call(c.generate, PROMPT, LONG)
    wait_running(c)
    new_sd = perturb(hf_model, seed=7)
    sender.push(new_sd.items(), version="a-new", pause_mode="abort")
    g = fut.result(timeout=300)
    assert g.aborted and 0 < len(g.output_ids) < LONG.max_new_tokens
    assert g.weight_version == "a-old"
    hf_model.load_state_dict(old_sd)
    old_lp = teacher_forced_logprobs(hf_model, PROMPT, g.output_ids)
    assert (old_lp - torch.tensor(g.output_logprobs)).abs().max().item() < 1e-4
    hf_model.load_state_dict(new_sd)
    assert c.generate(PROMPT, GREEDY).weight_version == "a-new"
    assert logprob_gap(c, hf_model)[1] < 1e-4


def test_load_from_disk_late_joiner(clients, hf_model, tmp_path):
    """A late-joining engine (here the third, outside the group) catches up from the last HF export."""
    sd = perturb(hf_model, seed=8)
    hf_model.save_pretrained(tmp_path / "export", safe_serialization=True)
    out = load_from_disk(clients[2], tmp_path / "export", version="disk-7")
    assert out["success"]
    assert clients[2].weight_version() == "disk-7"
    assert_engine_has(clients[2], sd)
    assert logprob_gap(clients[2], hf_model)[1] < 1e-4
    with pytest.raises(WeightSyncError, match=clients[2].url):
        load_from_disk(clients[2], tmp_path / "nothing-here", version="x")


def test_reconnect_with_a_new_engine_list(clients, hf_model):
    """Group membership is fixed at creation: a new engine list means a new group (reconnect)."""
    s = WeightSender(bucket_bytes=1 << 20, timeout=60, connect_timeout=60)
    try:
        s.connect([clients[2]], "127.0.0.1")
        assert s.world_size == 2
        s.reconnect(clients[1:3])
        assert s.world_size == 3 and s.rank_offsets == [1, 2]
        sd = perturb(hf_model, seed=9)
        s.push(sd.items(), "re-1")
        for c in clients[1:3]:
            assert_engine_has(c, sd)
    finally:
        s.close()


def test_engine_not_answering_at_connect_is_named():
    from relax_hpc.engines.launcher import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    s = WeightSender(connect_timeout=20, control_timeout=10)
    with pytest.raises(WeightSyncError) as e:
        s.connect([url], "127.0.0.1")
    # the connect failure itself, not a timeout, ended it
    msg = str(e.value)
    assert url in msg and e.value.engines == [url] and ("refused" in msg or "cannot connect" in msg), msg
    assert not s.connected


def test_engine_dying_during_connect_is_named_without_hanging():
    """The engine answers /server_info, then dies inside /init_weights_update_group: the error names it at
    once, instead of waiting for the group's rendezvous timeout."""
    p = subprocess.Popen([sys.executable, str(Path(__file__).with_name("dying_engine.py"))], stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{int(p.stdout.readline())}"
        s = WeightSender(timeout=8, connect_timeout=8)
        with pytest.raises(WeightSyncError) as e:
            s.connect([url], "127.0.0.1")
        assert url in str(e.value) and e.value.engines == [url], str(e.value)
        # named by its HTTP call (the engine's death), not by the group's rendezvous timeout
        assert "init_weights_update_group" in str(e.value) and "timed out" not in str(e.value), str(e.value)
        assert p.wait(timeout=10) == 3 and not s.connected
        # our half-built side of the group gives up at the group timeout; let it, rather than exit under it
        for th in threading.enumerate():
            if th.name == "weight-sync-rank0":
                th.join(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_dead_engine_during_push(engines, clients, hf_model):
    """An engine dies between connect and push: the push fails naming it, and the live engine is not left
    paused or inside a weight-update session."""
    s = WeightSender(bucket_bytes=1 << 20, timeout=20, connect_timeout=60, control_timeout=10)
    s.connect([clients[0], clients[2]], "127.0.0.1")
    try:
        engines[2].stop()  # by its PID's process group
        sd = perturb(hf_model, seed=10)
        with pytest.raises(WeightSyncError) as e:
            s.push(sd.items(), "never")
        assert clients[2].url in str(e.value) and e.value.engines == [clients[2].url]
        assert clients[0].url not in e.value.engines
        live = clients[0]
        assert live.weight_version() != "never"
        g = live.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), timeout=30)
        assert not g.aborted  # generating again: continue_generation reached it
        live.begin_weight_update()  # no session left open
        live.end_weight_update()
    finally:
        s.close()


def test_misuse():
    s = WeightSender()
    with pytest.raises(WeightSyncError, match="not connected"):
        s.push([], "1")
    with pytest.raises(ValueError):
        WeightSender(pause_mode="sleep")
    with pytest.raises(ValueError):
        WeightSender(mode="fast")
    with pytest.raises(ValueError):
        s.connect([], "127.0.0.1")


@pytest.mark.parametrize("version, protocol", [("0.5.23", "session"), ("0.5.23.post2", "session"),
                                               ("0.5.30", "session"), ("0.5.22", "plain"), ("v0.5.15", "plain"),
                                               ("relax_hpc-cpu-engine/1", "session"), (None, "session")])
def test_the_update_protocol_follows_the_sglang_release(version, protocol):
    from relax_hpc.engines.client import update_protocol

    assert update_protocol(version) == protocol


def test_an_sglang_older_than_relax_pins_is_refused_at_connect(tiny_model, tmp_path):
    from relax_hpc.engines.launcher import start_engine

    h = start_engine("cpu", tiny_model, log_path=tmp_path / "old.log",
                     extra_args=["--threads", "1", "--sglang-version", "0.5.14"]).wait_ready(180)
    try:
        with pytest.raises(WeightSyncError, match=r"SGLang 0\.5\.14.*0\.5\.15 or newer"):
            WeightSender(timeout=60, connect_timeout=60).connect([h.url], "127.0.0.1")
    finally:
        h.stop()


def test_one_group_with_an_older_and_a_current_sglang(clients, hf_model, tiny_model, tmp_path):
    """An engine answering as SGLang 0.5.20 has no update sessions (begin/end answer 404 there, and its updates
    come alone); one answering as the current release refuses updates outside a session. One push serves both."""
    from relax_hpc.engines.launcher import start_engine

    h = start_engine("cpu", tiny_model, log_path=tmp_path / "legacy.log",
                     extra_args=["--threads", "1", "--sglang-version", "0.5.20"]).wait_ready(180)
    legacy = EngineClient(h.url, timeout=60)
    s = WeightSender(bucket_bytes=1 << 20, timeout=60, connect_timeout=60)
    try:
        assert legacy.server_info()["version"] == "0.5.20"
        with pytest.raises(Exception, match="404"):
            legacy.begin_weight_update()
        s.connect([clients[1], legacy], "127.0.0.1")
        assert s.sessions == {clients[1].url: True, legacy.url: False}
        sd = perturb(hf_model, seed=10)
        s.push(sd.items(), "mixed-1")
        for c in (clients[1], legacy):
            assert_engine_has(c, sd)
            assert c.weight_version() == "mixed-1"
    finally:
        s.close()
        legacy.close()
        h.stop()
