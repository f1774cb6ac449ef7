"""The weight receiver's flattened bucket (engines/receiver.py over engines/bucket_wire.py): an announcement whose
layout SGLang refuses is refused before any byte is received, naming the tensor, instead of failing in the middle
(a real gloo group of one: the refusal comes before the broadcast)."""

from __future__ import annotations

import torch

from relax_hpc.engines.launcher import free_port
from relax_hpc.engines.receiver import WeightReceiver


def test_unaligned_flattened_bucket_is_refused_naming_the_tensor():
    params = {"model.x": torch.zeros(3, dtype=torch.bfloat16), "model.y": torch.zeros(2)}
    r = WeightReceiver(params)
    ok, msg = r.init_weights_update_group({"master_address": "127.0.0.1", "master_port": free_port("127.0.0.1"),
                                           "rank_offset": 0, "world_size": 1, "group_name": "g", "backend": "gloo"})
    assert ok, msg
    try:
        assert r.begin_weight_update()[0]
        body = {"names": ["model.x", "model.y"], "dtypes": ["bfloat16", "float32"], "shapes": [[3], [2]],
                "group_name": "g", "load_format": "flattened_bucket"}
        ok, msg = r.update_weights_from_distributed(body)
        assert not ok and "'model.y' (float32) would start at byte 6, not a multiple of 4" in msg
        ok, msg = r.update_weights_from_distributed({**body, "dtypes": ["bfloat16", "float77"]})
        assert not ok and "unknown dtype 'float77'" in msg
        assert all(not t.any() for t in params.values())  # nothing was loaded
    finally:
        r.end_weight_update()
        assert r.destroy_weights_update_group({"group_name": "g"})[0]
    assert "g" not in r.groups
