"""The quickstart's task: prompts, data file, and the reward in Relax's custom form."""

import asyncio
import json
from pathlib import Path

import pytest

from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.rewards import RewardRunner
from relax_hpc.rollout.sample import Sample
from relax_hpc.tasks import arith

DATA = Path(__file__).resolve().parents[2] / "recipes" / "data" / "arith.jsonl"


def test_the_data_file_is_the_55_prompts():
    recs = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert recs == arith.prompts() and len(recs) == 55
    assert all(int(r["prompt"][0]) + int(r["prompt"][2]) == int(r["label"]) <= 9 for r in recs)


@pytest.mark.parametrize("response, label, want", [
    ("7", "7", 1.0), ("7abc", "7", 1.0), ("6", "7", 0.0), ("8", "7", 0.0), ("0", "9", 0.0), ("9", "0", 0.0),
    ("x", "3", 0.0), ("", "3", 0.0), (" 3", "3", 0.0), ("٣", "3", 0.0),
])
def test_score(response, label, want):
    """Exact match only: a near digit earns nothing (partial credit collapsed the quickstart to middle digits)."""
    assert arith.score(response, label) == pytest.approx(want)


def test_reward_func_works_unchanged_through_relax_custom_rm_path():
    recipe = Recipe(rollout=RolloutConfig(custom_rm_path="relax_hpc.tasks.arith.reward_func", n_samples_per_prompt=2,
                                          rollout_batch_size=1, max_response_len=1))
    runner = RewardRunner(recipe)
    group = [Sample(prompt="3+4=", label="7", response="7"), Sample(prompt="3+4=", label="7", response="1")]
    failures = asyncio.run(runner.score_group(group))
    assert failures == [] and [s.reward for s in group] == [1.0, 0.0]


def test_main_writes_the_data(tmp_path):
    out = tmp_path / "a.jsonl"
    assert arith.main([str(out)]) == 0 and out.read_text() == DATA.read_text()


@pytest.mark.parametrize("response, label, want", [
    ("7", "7", 1.0), ("5", "7", 0.5 * (1 - 2 / 9)), ("0", "9", 0.0), ("x", "3", 0.0), ("", "3", 0.0),
])
def test_shaped_score_gives_near_digits_partial_credit(response, label, want):
    assert arith.shaped_score(response, label) == pytest.approx(want)
