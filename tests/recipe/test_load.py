"""Loading: defaults chains (later wins), configs/ names, overrides typed as YAML, resolved dump."""

from pathlib import Path

import pytest
import yaml

from relax_hpc.recipe import RecipeError, dump_recipe, load_recipe, recipe_from_dict, role_steps

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, name: str, data) -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def test_defaults_later_wins_and_file_wins_over_defaults(tmp_path):
    write(tmp_path, "a.yaml", {"run": {"seed": 1, "steps": 3}, "slurm": {"time": "00:05:00"}})
    write(tmp_path, "b.yaml", {"run": {"seed": 2}})
    r = write(tmp_path, "r.yaml", {"defaults": ["a.yaml", "b"], "run": {"steps": 7}})
    rec = load_recipe(r)
    assert (rec.run.seed, rec.run.steps, rec.slurm.time) == (2, 7, "00:05:00")
    assert rec.run.name == "r"  # defaults to the file name


def test_defaults_by_configs_name():
    rec = load_recipe(REPO / "recipes" / "smoke.yaml")
    assert rec.slurm.partition == "debug"  # from configs/cluster/dev-slurm.yaml
    assert rec.slurm.env["OMPI_MCA_btl"] == "self,tcp"


def test_overrides_are_yaml_typed(tmp_path):
    r = write(tmp_path, "r.yaml", {"run": {"name": "x"}})
    rec = load_recipe(r, ["run.steps=20", "train.lr=1e-5", "slurm.sbatch_extra=[--exclusive]",
                          "roles.reference.enabled=true", "slurm.env.FOO=a b"])
    assert rec.run.steps == 20 and rec.train.lr == 1e-5
    assert rec.slurm.sbatch_extra == ["--exclusive"]
    assert rec.roles.reference.enabled is True
    assert rec.slurm.env["FOO"] == "a b"


def test_override_syntax_error_names_it(tmp_path):
    r = write(tmp_path, "r.yaml", {})
    with pytest.raises(RecipeError, match="key.sub=value"):
        load_recipe(r, ["run.steps"])


def test_override_into_scalar_is_refused(tmp_path):
    r = write(tmp_path, "r.yaml", {})
    with pytest.raises(RecipeError) as e:
        load_recipe(r, ["mode.x=1"])
    assert e.value.problems[0][0] == "mode"


def test_defaults_cycle_and_missing_file(tmp_path):
    write(tmp_path, "a.yaml", {"defaults": ["b.yaml"]})
    write(tmp_path, "b.yaml", {"defaults": ["a.yaml"]})
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")
    r = write(tmp_path, "c.yaml", {"defaults": ["nope.yaml"]})
    with pytest.raises(RecipeError, match="no such file"):
        load_recipe(r)


def test_bad_yaml_names_the_line(tmp_path):
    r = write(tmp_path, "r.yaml", "run:\n  name: [unclosed\n")
    with pytest.raises(RecipeError, match="line"):
        load_recipe(r)


def test_dump_round_trips(tmp_path):
    rec = load_recipe(REPO / "recipes" / "smoke.yaml", ["run.seed=9"])
    again = recipe_from_dict(yaml.safe_load(dump_recipe(rec)))
    assert again == rec


def test_smoke_layout_fits_four_nodes():
    steps = role_steps(load_recipe(REPO / "recipes" / "smoke.yaml"))
    assert [(s.role, s.het_group, s.shared, s.ntasks) for s in steps] == [
        ("actor", 0, False, 2), ("rollout", 1, False, 1), ("reference", 2, False, 1), ("actor_fwd", 2, True, 1)]
    assert sum(s.nodes for s in steps if not s.shared) == 4


def test_shared_role_runs_in_host_component(tmp_path):
    r = write(tmp_path, "r.yaml", {"roles": {"reference": {"enabled": True},
                                             "actor_fwd": {"enabled": True, "share_with": "reference"}}})
    steps = {s.role: s for s in role_steps(load_recipe(r))}
    assert steps["actor_fwd"].het_group == steps["reference"].het_group == 2
    assert steps["actor_fwd"].shared and not steps["reference"].shared
