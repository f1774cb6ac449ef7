"""send_buckets → receive between two processes over a real gloo group: multi-dtype buckets, reused pack
buffers, both load formats, buckets packed ahead. (The engine tests cover the same sender against the CPU engine's
receiver.)"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from relax_hpc.weights.buckets import BufferRing, PackedBuckets, iter_buckets
from relax_hpc.weights.fingerprint import fingerprint
from relax_hpc.weights.sync import new_group, send_buckets


def test_send_buckets_to_receive():
    g = torch.Generator().manual_seed(0)
    dts = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    named = [(f"w{i}", (torch.randn((i % 7 + 1) * 37, 3, generator=g) * 50).to(dts[i % 4])) for i in range(40)]
    named.append(("big", torch.randn(5000, generator=g)))  # larger than a bucket: alone, not copied
    runs = [("bucketed", 2048, "flattened_bucket"), ("per_tensor", 2048, None), ("bucketed", 1 << 20, "flattened_bucket"),
            ("ahead", 2048, "flattened_bucket")]
    ahead = PackedBuckets(iter_buckets(named, 2048))  # cut and packed once, as a Snapshot's
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    store.set("runs", str(len(runs)))
    for k, (mode, bb, fmt) in enumerate(runs):
        plan = [[b.names, b.dtypes, b.shapes] for b in (ahead if mode == "ahead" else iter_buckets(named, bb))]
        store.set(f"plan/{k}", json.dumps({"buckets": plan, "load_format": fmt}))
    peer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("transport_peer.py")), str(store.port)])
    try:
        pg = new_group(store, 0, 2, "relax_test_transport", "gloo", timedelta(seconds=60))
        ring = BufferRing(2)
        for k, (mode, bb, _) in enumerate(runs):
            sent = []
            if mode == "ahead":  # sent as they are: the very buckets, none cut again (bucket_bytes says nothing then)
                stats = send_buckets(ahead, pg, 1, announce=sent.append)
                assert len(sent) == len(ahead) and all(a is b for a, b in zip(sent, ahead))
            else:
                stats = send_buckets(iter(named), pg, bb, mode=mode, ring=ring)
            assert stats["tensors"] == len(named)
            assert stats["bytes"] == sum(t.numel() * t.element_size() for _, t in named)
            assert store.get(f"fingerprint/{k}").decode() == fingerprint(named), (mode, bb)
        assert 0 < ring.nbytes <= 2 * (1 << 20)  # two reusable buffers of at most one bucket each
        store.set("done", "1")
        assert peer.wait(timeout=60) == 0
        dist.destroy_process_group(pg)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
