"""Loading: defaults chains (later wins), relax_hpc/configs/ names, overrides typed as YAML, resolved dump; the bounds
of the text (size, depth, aliases, UTF-8, regular files) and the order problems are reported in."""

import os
import re
import time
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
    assert rec.slurm.partition == "debug"  # from relax_hpc/configs/cluster/dev-slurm.yaml
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


# --- bounds: text that gives no recipe is refused naming the file (and line), never a crash or a hang (issue 28) ---

def refusal(path: Path, overrides=()) -> tuple[str, str]:
    """(the first problem's key, the whole message) of loading ``path``."""
    with pytest.raises(RecipeError) as e:
        load_recipe(path, list(overrides))
    assert e.value.source == str(path)
    return e.value.problems[0][0], str(e.value)


@pytest.mark.parametrize("text,says", [
    ("run: " + "[" * 1000 + "]" * 1000 + "\n", "line 1, column 37: nested more than 32 levels deep"),
    ("run:\n" + "".join(" " * (i + 1) + "- \n" for i in range(100)), "nested more than 32 levels deep"),
    ("a: &a0 [" + ", ".join(["lol"] * 9) + "]\n" + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n"
                                                     for i in range(1, 9)), "alias bomb"),
    ("m0: &m0 {x: 1, y: 2}\n" + "".join(f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * 4)}], k{i}: 1}}\n"
                                        for i in range(1, 10)), "alias bomb"),  # merge keys copy pairs: bounded too
    ("a: &r [1, *r]\n", "the alias *r is inside the value it names"),
    ("d: [" + ", ".join(["&x [" + ", ".join(["1"] * 40) + "]"] + ["*x"] * 200) + "]\n", "alias bomb"),
    ("run: {name: " + "[" * 33 + "]" * 33 + "}\n", "nested more than 32 levels"),
])
def test_yaml_over_the_bounds_is_refused_quickly_with_its_line(tmp_path, text, says):
    r = write(tmp_path, "r.yaml", text)
    start = time.monotonic()
    key, msg = refusal(r)
    assert key == "<yaml>" and says in msg and re.search(r"line \d+, column \d+", msg), msg
    assert time.monotonic() - start < 2


def test_anchors_and_merge_keys_within_the_bounds_still_work(tmp_path):
    r = write(tmp_path, "r.yaml", "roles:\n  actor: &one {nodes: 1, cpus_per_task: 2}\n  rollout: *one\n"
                                  "slurm: {env: &env {A: '1'}}\nrollout: {stop: [a, b]}\n"
                                  "genrm: {sampling: {chat_template_kwargs: {<<: *env, B: 2}}}\n")
    rec = load_recipe(r)
    assert rec.roles.rollout.cpus_per_task == 2 and rec.genrm.sampling.chat_template_kwargs == {"A": "1", "B": 2}


@pytest.mark.parametrize("data,says", [
    (b"run:\n  name: caf\xe9\n", "is not UTF-8 text: byte 0xe9 at line 2, column 12"),
    (b"run: {name: x}\nmodel: {path: \xed\xa0\x80}\n", "is not UTF-8 text: byte 0xed at line 2, column 15"),
    (b"run: {name: x}\n\x00\n", "holds the character '\\x00' at line 2, column 1"),
    (b"run: {name: 2024-13-01}\n", "holds a value YAML cannot build: month must be in 1..12"),
    (b"x" * (300 << 10), "more than the 262144 a recipe may have"),
])
def test_text_that_is_not_a_recipe_names_the_file(tmp_path, data, says):
    r = tmp_path / "r.yaml"
    r.write_bytes(data)
    key, msg = refusal(r)
    assert key == "<file>" and says in msg and str(r) in msg, msg


def test_a_recipe_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path):
    os.mkfifo(tmp_path / "fifo.yaml")  # opening it for reading would wait for a writer for ever
    assert "is not a regular file but a FIFO" in refusal(tmp_path / "fifo.yaml")[1]
    assert "is not a regular file but a directory" in refusal(tmp_path)[1]
    assert "is not a regular file but a character device" in refusal(Path("/dev/zero"))[1]
    r = write(tmp_path, "r.yaml", {"defaults": [str(tmp_path / "fifo.yaml")]})
    key, msg = refusal(r)
    assert key == "<file>" and "a FIFO" in msg and f"(listed in defaults: of {r})" in msg


def test_defaults_are_bounded(tmp_path):
    write(tmp_path, "a.yaml", {"run": {"seed": 1}})
    r = write(tmp_path, "r.yaml", {"defaults": ["a.yaml"] * 100})
    assert "reads more than 64 files" in refusal(r)[1]
    r = write(tmp_path, "r.yaml", 'defaults: ["a\\0b"]\n')
    assert "is not a file name" in refusal(r)[1]
    r = write(tmp_path, "r.yaml", "[1, 2]\n")
    assert "the top level must be a mapping of sections, not list" in refusal(r)[1]


@pytest.mark.parametrize("override,key,says", [
    ("rollout.stop=" + "[" * 40 + "]" * 40, "rollout.stop", "nested more than 32 levels deep"),
    ("rollout.stop=[&b0 [1, 1, 1, 1, 1, 1, 1, 1], " + ", ".join(f"&b{i} [{', '.join([f'*b{i - 1}'] * 8)}]"
                                                            for i in range(1, 7)) + "]", "rollout.stop", "alias bomb"),
    ("a." * 40 + "b=1", "<override>", "32 keys deep"),
    ("slurm.env." + "x." * 20 + "y=" + "[" * 20 + "]" * 20, "slurm.env." + "x." * 20 + "y", "nest more than 32"),
    ("run.name=" + "x" * (300 << 10), "<override>", "longer than 262144 characters"),
])
def test_overrides_have_the_bounds_of_a_file(tmp_path, override, key, says):
    r = write(tmp_path, "r.yaml", {"run": {"name": "x"}})
    got, msg = refusal(r, [override])
    assert got == key and says in msg, msg


def test_a_lone_surrogate_on_the_command_line_is_refused_by_key(tmp_path):
    """A byte that is not UTF-8 in argv reaches Python as a lone surrogate (surrogateescape)."""
    r = write(tmp_path, "r.yaml", {"run": {"name": "x"}})
    _, msg = refusal(r, [os.fsdecode(b"model.path=/m/\xff"), os.fsdecode(b"slurm.env.\xff=1")])
    assert "model.path = '/m/\\udcff': contains a character that cannot be encoded as UTF-8" in msg
    assert "slurm.env[\\udcff]: keys must be strings of UTF-8 text" in msg


def test_problems_about_keys_the_user_set_come_first(tmp_path):
    """Command-line keys, then the file's, then keys nobody set (a default that a set value no longer fits)."""
    from relax_hpc.recipe.load import read_recipe

    r = write(tmp_path, "r.yaml", {"run": {"name": "x"}, "train": {"tp": 3},
                                   "logging": {"heartbeat_s": 100.0}})
    loaded = read_recipe(r, ["roles.actor.nodes=2", "roles.rollout.nodes=0", "slurm.sbatch_extra=['a;b']"])
    assert [k for k, _, _ in loaded.problems] == [  # found in the order train.tp, rollout.nodes, sbatch_extra, ...
        "slurm.sbatch_extra[0]", "roles.rollout.nodes", "train.tp", "logging.heartbeat_timeout_s"]
    assert loaded.typed and loaded.override_keys == ["roles.actor.nodes", "roles.rollout.nodes", "slurm.sbatch_extra"]
