"""Weight-sync parity, in one process of its own (Megatron's global state stays out of pytest):

    python tests/e2e/parity_worker.py MODEL_DIR OUT.json

A world-1 gloo Megatron actor and a CPU engine subprocess on the same tiny model; the actor trains one
step (so its weights differ from the files the engine loaded), then pushes them with WeightSender as
version "1". Written to OUT.json: whole-model fingerprints before and after, the engine's version, the
versions the driver's samples carry, and the largest |engine − actor| log-prob over the sampled tokens.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main(model: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from relax_hpc.algo import AlgorithmConfig
    from relax_hpc.recipe import load_recipe
    from relax_hpc.rollout.data import data_source_from_config, dataset_from_config, load_tokenizer
    from relax_hpc.rollout.driver import RolloutDriver
    from relax_hpc.engines.launcher import launch_engine
    from relax_hpc.train import plan as P
    from relax_hpc.rollout.write import write_step
    from relax_hpc.train.actor import MegatronActor
    from relax_hpc.train.batch import TrainingSample
    from relax_hpc.train.config import TrainConfig
    from relax_hpc.train.parallel import init_parallel
    from relax_hpc.weights import WeightSender, engine_fingerprint, fingerprint

    torch.set_num_threads(1)
    res: dict = {}
    engine = launch_engine("cpu", model, log_path=Path(out).with_suffix(".engine.log"),
                           extra_args=["--threads", "1", "--seed", "0", "--weight-version", "0"])
    try:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        init_parallel(1, 1, seed=0)
        algo = AlgorithmConfig()
        actor = MegatronActor.from_hf(model, TrainConfig(lr=1e-2, micro_batch_size=64, seed=0), algo, temperature=1.0)
        client = engine.client()
        names = sorted(n for n, _ in actor.named_hf_weights())
        res["fingerprint_engine_start"] = engine_fingerprint(client, names)
        res["fingerprint_actor_start"] = fingerprint(actor.named_hf_weights())

        # the actor moves away from the files: one GRPO step on a made-up batch
        g = torch.Generator().manual_seed(0)
        batch = [TrainingSample.of(torch.randint(6, 128, (9,), generator=g), 4, advantage=1.0 if i % 2 else -1.0)
                 for i in range(16)]
        res["train_metrics"] = actor.train_step(batch)
        res["fingerprint_actor_trained"] = fingerprint(actor.named_hf_weights())

        sender = WeightSender(backend="gloo")
        sender.connect([engine.url], "127.0.0.1")
        t0 = time.monotonic()
        res["push"] = sender.push(actor.named_hf_weights(), "1")
        res["push_s"] = time.monotonic() - t0
        res["fingerprint_engine_synced"] = engine_fingerprint(client, names)
        res["fingerprint_actor_synced"] = fingerprint(actor.named_hf_weights())
        res["engine_version"] = client.weight_version()

        # samples from the driver after the sync: their version, and the engine's log-probs vs the actor's
        recipe = load_recipe(REPO / "recipes" / "quickstart.yaml",
                             [f"model.path={model}", f"data.path={REPO / 'recipes' / 'data' / 'arith.jsonl'}",
                              "rollout.max_response_len=6", "rollout.rollout_batch_size=8",
                              "rollout.n_samples_per_prompt=4"])
        tok = load_tokenizer(model)
        ds = dataset_from_config(recipe.data, recipe.rollout, tokenizer=tok, path=recipe.data.path)
        src = data_source_from_config(ds, recipe.data, recipe.rollout, run_seed=0)
        driver = RolloutDriver(recipe, {"engine0": engine.url}, tokenizer=tok)
        result = driver.generate_rollout_sync(src.get_samples())
        res["sample_versions"] = sorted({s.weight_version for s in result.samples})
        ref = write_step(Path(out).parent / "run", 1, result)  # the same path the run takes: chunk → batch
        train_batch, _ = P.read_train_batch([ref.to_dict()], algo, result.group_size)
        lps = actor.compute_log_probs(train_batch)
        diffs = [float((lp - s.rollout_log_probs).abs().max()) for s, lp in zip(train_batch, lps)]
        res["n_samples"] = len(diffs)
        res["n_tokens"] = int(sum(len(lp) for lp in lps))
        res["logprob_max_abs_diff"] = max(diffs)
        sender.close()
    finally:
        engine.stop()
        Path(out).write_text(json.dumps(res, indent=1, default=float))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
