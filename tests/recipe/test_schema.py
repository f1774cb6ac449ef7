"""The schema as composed from each package's own config module: importable on a login node, one default seed."""

from __future__ import annotations

import json
import subprocess
import sys

from relax_hpc.recipe import recipe_from_dict
from relax_hpc.rollout.data import DataKeys, PromptDataset, data_source_from_config
from relax_hpc.seed import DEFAULT_SEED


def test_the_validator_and_every_section_load_without_torch():
    """The validator runs before submit, on a login node that may have no torch: the config modules it composes
    (algo, train, rollout) must not pull it in."""
    code = ("import sys; from relax_hpc.recipe import recipe_from_dict; "
            "recipe_from_dict({'rollout': {'top_k': 5}, 'data': {'shuffle': True}, 'genrm': {'retries': 1}, "
            "'algorithm': {'kl_loss_type': 'k3'}, 'train': {'tp': 1}}); "
            "print([m for m in ('torch', 'megatron') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_one_default_seed_for_the_run_the_trainer_and_the_data_order(tmp_path):
    r = recipe_from_dict({})
    assert r.run.seed == r.train.seed == DEFAULT_SEED == 1234
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(9)))
    ds = PromptDataset(path, keys=DataKeys("prompt"))
    cfg = recipe_from_dict({"data": {"shuffle": True}})
    unset = data_source_from_config(ds, cfg.data, cfg.rollout)  # no run seed given: the default
    assert unset.seed == DEFAULT_SEED
    assert unset.state_dict() == data_source_from_config(ds, cfg.data, cfg.rollout, run_seed=r.run.seed).state_dict()
    assert data_source_from_config(ds, cfg.data, cfg.rollout, run_seed=7).seed == 7  # a run's seed wins
