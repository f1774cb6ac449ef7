"""sync.receive (the receive path of receivers that are not SGLang) reads a flattened bucket of several dtypes as
SGLang 0.5.23 lays it out (relax_hpc.engines.bucket_wire): each tensor's bytes end to end, over a real gloo group
with transport_peer.py as the receiving rank. (Before the one bucket wire, receive allocated torch.cat's promoted
dtype: 11 float32 elements, 44 bytes, for the 21 bytes sent here.)"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from relax_hpc.engines import bucket_wire
from relax_hpc.weights.fingerprint import fingerprint
from relax_hpc.weights.sync import new_group


def test_receive_takes_a_mixed_dtype_bucket_in_the_wire_layout():
    named = [("m0", torch.tensor([1.5, -2.0])), ("m1", torch.tensor([[0.5], [3.0], [-7.0]], dtype=torch.bfloat16)),
             ("m2", torch.tensor(2.25, dtype=torch.float16)), ("m3", torch.zeros(0, 4)),
             ("m4", torch.tensor([1, -2, 3, -4, 5], dtype=torch.int8))]
    flat, metas = bucket_wire.pack(named)
    assert flat.numel() == 21
    announce = [[m.name for m in metas], [bucket_wire.dtype_name(m.dtype) for m in metas], [list(m.shape) for m in metas]]
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    store.set("runs", "1")
    store.set("plan/0", json.dumps({"buckets": [announce], "load_format": "flattened_bucket"}))
    peer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("transport_peer.py")), str(store.port)])
    try:
        pg = new_group(store, 0, 2, "relax_test_transport", "gloo", timedelta(seconds=60))
        dist.broadcast(flat, src=0, group=pg)  # the bytes, as send_buckets broadcasts them
        assert store.get("fingerprint/0").decode() == fingerprint(named)
        store.set("done", "1")
        assert peer.wait(timeout=60) == 0
        dist.destroy_process_group(pg)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
