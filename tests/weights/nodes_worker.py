"""One actor rank of test_push_nodes, in its own process: a world of actor ranks (gloo, a file store), each told its
node, syncs the same weights to engines placed on those nodes, as multi-node colocate does.

    python nodes_worker.py RANK WORLD NODE STORE_FILE OUT_DIR PLAN_JSON

PLAN_JSON: {"model": HF dir, "engines": {name: url}, "nodes": {name: node}, "seed": perturbation seed,
"steps": how many release + sync rounds}. Writes OUT_DIR/rank<RANK>.json: what this rank sent to, its metrics, rank
0's route, or the error it raised.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.weights.hf_export import HFModel  # noqa: E402 - after the path



def main() -> int:
    rank, world, node, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5])
    plan = json.loads(sys.argv[6])
    res: dict = {"rank": rank, "node": node}
    status = 0
    try:
        import torch
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        from relax_hpc.weights import ActorSync

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        model = AutoModelForCausalLM.from_pretrained(plan["model"], dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(plan["seed"])  # the same weights on every rank
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        sync = ActorSync(rank, None, None, address=lambda: "127.0.0.1", offload=True, node=node)
        try:
            sync.connect(plan["engines"], {}, plan["nodes"])
            res["mine"] = sorted(sync.mine)
            res["sender_engines"] = sorted(e.url for e in sync.sender.engines) if sync.sender else []
            res["route"] = sync.route()
            res["released"], res["synced"] = [], []
            for step in range(1, plan["steps"] + 1):
                res["released"].append(sync.release())
                done = sync.sync(str(step), None, HFModel(model), progress=lambda: None, check=True)
                res["synced"].append(done.metrics)
                # the actor's next task comes after rank 0's result, its check of every engine included
                dist.barrier()
                res["versions"] = done.engine_versions
        finally:
            sync.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        res["error"] = f"{type(e).__name__}: {e}"
        res["restartable"] = getattr(e, "restartable", None)
        res["trace"] = traceback.format_exc()
        status = 1
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(res, default=str))
    os.replace(tmp, out / f"rank{rank}.json")
    sys.stdout.flush()
    os._exit(status)  # skip gloo's teardown


if __name__ == "__main__":
    main()
