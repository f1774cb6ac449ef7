"""Rank 1 of test_weight_transport: receives announced buckets with relax_hpc.weights.sync.receive (SGLang's
receive path) and reports the fingerprint of everything it got.

    python transport_peer.py PORT       (the plan comes through the store: key "plan", JSON)
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from relax_hpc.weights.fingerprint import fingerprint  # noqa: E402
from relax_hpc.weights.sync import new_group, receive  # noqa: E402

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), world_size=None, is_master=False, timeout=timedelta(seconds=60))
pg = new_group(store, 1, 2, "relax_test_transport", "gloo", timedelta(seconds=60))
for run in range(int(store.get("runs"))):
    cmd = json.loads(store.get(f"plan/{run}"))
    got = []
    for names, dtypes, shapes in cmd["buckets"]:
        got += receive(names, dtypes, shapes, pg, load_format=cmd["load_format"])
    store.set(f"fingerprint/{run}", fingerprint(got))
store.get("done")  # rank 0 read every fingerprint: both sides now leave the group together
dist.destroy_process_group(pg)
sys.stdout.flush()
# As the engines do (cpu_engine.py): gloo's threads may still be winding down at interpreter teardown, where a
# joinable std::thread aborts the process ("terminate called without an active exception", seen once in CI).
os._exit(0)
