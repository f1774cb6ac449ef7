"""The actor side of test_actor_sync, in its own process (megatron's parallel state and the CPU compatibility
layer are process-wide): a real MegatronActor (world 1, gloo) built from the tiny HF model, one GRPO step so
its weights differ from the checkpoint, then a weight sync to the engine through the bridge's HF names.

    python actor_worker.py HF_DIR ENGINE_URL OUT_DIR     → OUT_DIR/result.json
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    hf_dir, url, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    res: dict = {}
    try:
        import torch
        import torch.distributed as dist

        from relax_hpc.algo import AlgorithmConfig
        from relax_hpc.engines.client import EngineClient
        from relax_hpc.train import MegatronActor, TrainConfig, init_parallel
        from relax_hpc.train import cpu_compat
        from relax_hpc.train.batch import TrainingSample
        from relax_hpc.weights import WeightSender, fingerprint, push_from_actor

        dist.init_process_group(cpu_compat.backend(), store=dist.HashStore(), rank=0, world_size=1)
        init_parallel(1, 1, seed=1)
        actor = MegatronActor.from_hf(hf_dir, TrainConfig(lr=1e-3, micro_batch_size=2, seed=1), AlgorithmConfig())
        g = torch.Generator().manual_seed(0)
        batch = []
        for i in range(4):
            tokens = torch.randint(6, 128, (12,), generator=g)
            batch.append(TrainingSample.of(tokens, 4, advantage=[1.0, -1.0, 0.5, -0.5][i]))
        res["train"] = actor.train_step(batch)
        # runs of parameters that lie end to end in the DDP param buffer go out as they lie (no minimum: the
        # tiny model's runs are small); the engine's fingerprint below shows they arrived exact
        sender = WeightSender(bucket_bytes=64 * 1024, timeout=120, connect_timeout=60, in_place_min_bytes=0)
        sender.connect([EngineClient(url)], "127.0.0.1")
        t0 = time.time()
        res["metrics"] = push_from_actor(actor.named_hf_weights(), sender, "actor-1", in_place=actor.in_place())
        res["push_s"] = time.time() - t0
        sender.close()
        named = dict(actor.named_hf_weights())
        res["fingerprint"] = fingerprint(named)
        res["names"] = sorted(named)
        actor.export_hf(out / "export")
        status = 0
    except Exception:
        traceback.print_exc()
        res["error"] = traceback.format_exc()
        status = 1
    tmp = out / "result.json.tmp"
    tmp.write_text(json.dumps(res))
    os.replace(tmp, out / "result.json")
    sys.stdout.flush()
    os._exit(status)  # skip megatron/gloo teardown


if __name__ == "__main__":
    main()
