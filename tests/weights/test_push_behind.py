"""train.overlap_sync's actor side (relax_hpc.weights.push): the snapshot a push behind the next train sends, the solo
sync that sends it from rank 0 alone, and the one push in flight (BackgroundPush). A real CPU engine, a real world-1
gloo group, real threads."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from relax_hpc.engines.client import EngineClient
from relax_hpc.weights import WeightSyncError, engine_fingerprint, fingerprint
from relax_hpc.weights.buckets import PackedBuckets
from relax_hpc.weights.push import ActorSync, BackgroundPush, take_snapshot

from .hf_export import HFModel
from .conftest import perturb

N_ENGINES = 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_export_is_snapshotted_into_host_memory_the_next_train_cannot_change(hf_model):
    """On a GPU the export's tensors are on the device: the snapshot's buckets are moved to host memory (the device
    keeps its memory for the next train), with the same values."""
    model = copy.deepcopy(hf_model).to("cuda")  # the fixture is shared: a copy of its own
    live = {n: t.detach().cpu().clone() for n, t in model.state_dict().items()}
    snap = take_snapshot(HFModel(model), 0, bucket_bytes=64 * 1024)
    assert snap.flats and all(f.device.type == "cpu" for f in snap.flats)
    assert all(torch.equal(t, live[n]) for n, t in snap.named)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next train's update, on the device
    assert all(torch.equal(t, live[n]) for n, t in snap.named)


def test_the_snapshot_is_a_copy_the_next_train_cannot_change_packed_as_the_sender_cuts_buckets(hf_model):
    live = dict(hf_model.state_dict())
    snap = take_snapshot(HFModel(hf_model), 0, bucket_bytes=64 * 1024)
    before = {n: t.clone() for n, t in snap.named}
    assert before.keys() == live.keys() and all(torch.equal(before[n], live[n]) for n in live)
    perturb(hf_model, seed=3)  # the next train's update, in place
    assert all(torch.equal(t, before[n]) for n, t in snap.named_hf_weights())
    assert snap.nbytes == sum(t.numel() * t.element_size() for t in live.values())
    # as the sender would cut them: at most 64 KiB a bucket, a larger tensor alone; each bucket's tensors end to end
    assert all(f.numel() * f.element_size() <= 64 * 1024 or len([1 for _, t in snap.named if
               t.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()]) == 1 for f in snap.flats)
    # the push takes the buckets as they are (PackedBuckets), each its own memory, never the model's
    ptrs = {t.untyped_storage().data_ptr() for t in live.values()}
    assert isinstance(snap.buckets, PackedBuckets) and all(b.in_place for b in snap.buckets)
    assert not {b.flat.untyped_storage().data_ptr() for b in snap.buckets} & ptrs
    assert take_snapshot(HFModel(hf_model), 1) is None, "other ranks walk the export and keep nothing"


def test_a_solo_push_of_the_snapshot_lands_the_snapshotted_weights_while_the_model_trains_on(engines, hf_model, world):
    url = engines[0].url
    s = ActorSync(0, None, None, address=lambda: "127.0.0.1")
    s.connect({"engine0": url}, {})
    c = EngineClient(url)
    try:
        assert s.solo_ok({"engine0": url}, {"engine0": "n1"}), "one actor rank: rank 0 sends to every engine"
        sent = dict(perturb(hf_model, seed=5))
        snap = take_snapshot(HFModel(hf_model), 0)
        behind = BackgroundPush()
        reports = []
        behind.start(lambda: s.sync("7", None, snap, progress=lambda: None, check=True, solo=True),
                     lambda outcome, seconds: reports.append((outcome, seconds)))
        perturb(hf_model, seed=6)  # the next train runs while the push is on its way
        behind.wait()
        (kind, done), seconds = reports[0]
        assert kind == "ok" and seconds > 0
        assert done.engine_versions == {"engine0": "7"} and done.metrics["weights/fingerprint_match"] == 1.0
        # packed ahead: every bucket goes out as it lies in the snapshot, no pack copy in the push
        assert done.metrics["perf/weight_sync_in_place_bytes"] == done.metrics["perf/weight_sync_bytes"] == snap.nbytes
        assert engine_fingerprint(c, sorted(sent)) == fingerprint(sent), "the engine holds the snapshot's weights"
        assert c.weight_version() == "7"
    finally:
        c.close()
        s.close()


def test_one_push_at_a_time_and_a_failed_one_fails_the_next_task():
    behind, order, gate = BackgroundPush(), [], threading.Event()
    reports = []

    def first():
        gate.wait(30)
        order.append("first")
        raise WeightSyncError("update_weights_from_distributed failed on engine http://e0", ["http://e0"])

    behind.start(first, lambda outcome, s: reports.append(outcome))
    assert behind.busy
    gate.set()
    with pytest.raises(WeightSyncError, match="behind the last train failed.*http://e0"):
        behind.wait()  # the next sync (or a stop) of the actor: it does not go on from engines in doubt
    assert reports[0][0] == "error" and "http://e0" in str(reports[0][1]), "the controller hears the failure"
    behind.start(lambda: order.append("second") or 2, lambda outcome, s: reports.append(outcome))
    behind.start(lambda: order.append("third") or 3, lambda outcome, s: reports.append(outcome))  # waits for 2nd
    behind.wait()
    assert order == ["first", "second", "third"] and [r[1] for r in reports[1:]] == [2, 3]
    behind.wait()  # nothing in flight: returns at once
