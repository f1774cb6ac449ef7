"""Validation: every bad value is refused with its key, its value and a fix, all problems at once."""

import json
import sys
from pathlib import Path

import pytest

from relax_hpc.launch.files import check_files
from relax_hpc.recipe import RecipeError, recipe_from_dict
from relax_hpc.recipe.relax_names import RELAX_NAMES
from relax_hpc.recipe.validate import schema_keys
from relax_hpc.rollout.rewards import BUILTIN_REWARDS

REPO = Path(__file__).resolve().parents[2]


def problems(data) -> dict[str, str]:
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(data)
    return {k: m for k, _, m in e.value.problems}


def test_defaults_are_valid():
    r = recipe_from_dict({})
    assert r.mode == "colocate" and r.roles.actor.enabled


@pytest.mark.parametrize("data,key,text", [
    ({"run": {"steps": "ten"}}, "run.steps", "integer"),
    ({"run": {"steps": True}}, "run.steps", "integer"),
    ({"roles": {"actor": {"nodes": 1.5}}}, "roles.actor.nodes", "integer"),
    ({"slurm": {"requeue": "yes"}}, "slurm.requeue", "true or false"),
    ({"slurm": {"sbatch_extra": "--exclusive"}}, "slurm.sbatch_extra", "list"),
    ({"slurm": "debug"}, "slurm", "mapping"),
    ({"mode": "async"}, "mode", "one of"),
    ({"slurm": {"mpi": "pmi2"}}, "slurm.mpi", "one of"),
])
def test_wrong_types(data, key, text):
    assert text in problems(data)[key]


def test_unknown_keys_suggest():
    p = problems({"roles": {"actor": {"nodse": 2}}, "slrum": {}})
    assert "did you mean 'nodes'" in p["roles.actor.nodse"]
    assert "did you mean 'slurm'" in p["slrum"]


def test_all_problems_reported_at_once():
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"run": {"steps": "x", "seed": "y"}, "bogus": 1})
    assert len(e.value.problems) == 3
    text = str(e.value)
    assert "run.steps = 'x'" in text and "nothing was submitted" in text


@pytest.mark.parametrize("key,value", [
    ("partition", "debug; rm -rf /"), ("account", "$(whoami)"), ("qos", "a`id`"),
    ("constraint", "a|b"), ("job_name", "x y"), ("time", "1:00 && id"),
])
def test_shell_metacharacters_refused(key, value):
    msg = problems({"slurm": {key: value}})[f"slurm.{key}"]
    assert "Fix:" in msg


def test_metacharacters_in_lists_and_names():
    p = problems({"slurm": {"sbatch_extra": ["--exclusive", "--comment=a;b"],
                            "srun_args": ["$(id)"], "env": {"A B": "x"}},
                  "run": {"name": "../evil"}, "roles": {"actor": {"mem": "4G; id"}}})
    assert set(p) == {"slurm.sbatch_extra[1]", "slurm.srun_args[0]", "slurm.env.A B", "run.name", "roles.actor.mem"}
    assert "';'" in p["slurm.sbatch_extra[1]"]


def test_env_values_may_hold_spaces_and_newlines_not_nul():
    """slurm.env's values travel in the steps' environment (secrets: never in the script): a newline is fine there,
    a NUL cannot be; and a refused value is never shown (it may be a token)."""
    assert recipe_from_dict({"slurm": {"env": {"X": "a b; c"}}}).slurm.env["X"] == "a b; c"
    assert recipe_from_dict({"slurm": {"env": {"X": "a\nb"}}}).slurm.env["X"] == "a\nb"
    assert "NUL" in problems({"slurm": {"env": {"X": "a\0b"}}})["slurm.env.X"]
    with pytest.raises(RecipeError) as ei:
        recipe_from_dict({"slurm": {"env": {"SLURM_JOB_ID": "hf_SECRETVALUE"}}})
    assert "hf_SECRETVALUE" not in str(ei.value) and "slurm.env.SLURM_JOB_ID = ***" in str(ei.value)


def test_tp_pp_must_divide_actor_ranks():
    msg = problems({"train": {"tp": 3}, "roles": {"actor": {"nodes": 2, "tasks_per_node": 4}}})["train.tp"]
    assert "= 3 does not divide the actor's 8 ranks" in msg


def test_share_with_rules():
    p = problems({"roles": {"actor_fwd": {"enabled": True, "share_with": "reference"}}})
    assert "disabled" in p["roles.actor_fwd.share_with"]
    p = problems({"roles": {"rollout": {"share_with": "rollout"}}})
    assert "another role" in p["roles.rollout.share_with"]


def test_sharing_role_cannot_exceed_host_nodes():
    p = problems({"roles": {"reference": {"enabled": True, "nodes": 2, "share_with": "actor"}}})
    assert "at most its 1 node" in p["roles.reference.nodes"]


def test_resource_minimums_and_actor_required():
    p = problems({"roles": {"actor": {"enabled": False}, "rollout": {"nodes": 0, "gpus_per_node": -1}}})
    assert {"roles.actor.enabled", "roles.rollout.nodes", "roles.rollout.gpus_per_node"} <= set(p)


def test_colocate_is_on_policy():
    assert "fully_async" in problems({"max_staleness": 2})["max_staleness"]
    assert recipe_from_dict({"mode": "fully_async", "max_staleness": 2}).max_staleness == 2


def test_kl_loss_without_a_reference_is_refused_before_the_queue():
    """The controller refused it too, but only once the job had started."""
    msg = problems({"algorithm": {"use_kl_loss": True}})["algorithm.use_kl_loss"]
    assert "roles.reference.enabled: true" in msg and "Fix:" in msg
    ok = recipe_from_dict({"algorithm": {"use_kl_loss": True}, "roles": {"reference": {"enabled": True}}})
    assert ok.algorithm.use_kl_loss


def test_section_checks_are_prefixed():
    p = problems({"train": {"lr": -1.0}, "algorithm": {"eps_clip": 2.0}})
    assert "train.lr" in p and "algorithm.eps_clip" in p


def test_survival_knobs_and_notification_urls():
    p = problems({"checkpoint": {"keep": 0, "max_restarts": -1}, "slurm": {"max_requeues": -2},
                  "logging": {"notify_urls": ["json://127.0.0.1:9/", "nonsense://token@host"]}})
    assert {"checkpoint.keep", "checkpoint.max_restarts", "slurm.max_requeues"} <= set(p)
    assert "Apprise" in p["logging.notify_urls[1]"] and "logging.notify_urls[0]" not in p



def error(data) -> RecipeError:
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(data)
    return e.value


def line(err: RecipeError, key: str) -> str:
    """The rendered line of ``key``: what the user reads, with the key, the value and the message."""
    found = [ln for ln in str(err).splitlines() if ln.startswith(f"  - {key} = ") or ln.startswith(f"  - {key}: ")]
    assert len(found) == 1, str(err)
    return found[0]


# --- 1. newlines in strings that reach the sbatch script ------------------------------------------------

@pytest.mark.parametrize("data,key", [
    ({"slurm": {"partition": "debug\n"}}, "slurm.partition"),
    ({"slurm": {"account": "proj\n"}}, "slurm.account"),
    ({"slurm": {"job_name": "x\n"}}, "slurm.job_name"),
    ({"slurm": {"time": "01:00:00\n"}}, "slurm.time"),
    ({"slurm": {"sbatch_extra": ["--exclusive\n"]}}, "slurm.sbatch_extra[0]"),
    ({"slurm": {"srun_args": ["--overlap\n"]}}, "slurm.srun_args[0]"),
    ({"run": {"name": "exp1\n"}}, "run.name"),
    ({"run": {"runs_root": "/scratch/runs\n"}}, "run.runs_root"),
    ({"roles": {"actor": {"mem": "16G\n"}}}, "roles.actor.mem"),
])
def test_trailing_newline_is_refused_naming_the_key(data, key):
    """`$` matches before a final newline, so these passed and sbatch's renderer refused them later, keyless."""
    (k, value, msg), = [p for p in error(data).problems if p[0] == key]
    assert value.endswith("\n") and "ends in a newline" in msg and "Fix:" in msg
    assert repr(value.rstrip("\n")) in msg  # the fix shows the value without it


def test_newline_in_an_env_name_is_refused_and_shown_escaped():
    err = error({"slurm": {"env": {"FOO\n": "1"}}})
    assert "  - slurm.env['FOO\\n'] = ***: the variable name 'FOO\\n' must be letters" in str(err)


def test_inner_newline_is_said_to_be_inside():
    (_, value, msg), = error({"slurm": {"qos": "a\nb"}}).problems
    assert value == "a\nb" and "contains a newline" in msg


def test_yaml_block_scalar_partition_is_refused_at_load(tmp_path):
    """The way a trailing newline gets in: a YAML '|' block."""
    from relax_hpc.recipe import load_recipe

    r = tmp_path / "r.yaml"
    r.write_text("slurm:\n  partition: |\n    debug\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(r)
    assert "slurm.partition = 'debug\\n': ends in a newline" in str(e.value)


# --- 3. Slurm filename patterns in runs_root --------------------------------------------------------------

@pytest.mark.parametrize("root", ["/scratch/%u/runs", "runs-%j", "a\\b"])
def test_runs_root_with_slurm_patterns_is_refused(root):
    msg = problems({"run": {"runs_root": root}})["run.runs_root"]
    assert "'%'" in msg and "filename pattern" in msg and "Fix: a plain directory path" in msg
    assert f"run.runs_root = {root!r}" in str(error({"run": {"runs_root": root}}))


def test_plain_runs_root_passes():
    assert recipe_from_dict({"run": {"runs_root": "~/scratch/runs-1"}}).run.runs_root == "~/scratch/runs-1"


# --- 5. unknown rm_type ------------------------------------------------------------------------------------

def test_unknown_rm_type_is_refused_listing_the_known_ones():
    err = error({"rollout": {"rm_type": "ifbench"}})
    text = line(err, "rollout.rm_type")
    assert "rollout.rm_type = 'ifbench'" in text and "Fix: use one of" in text
    assert all(name in text for name in BUILTIN_REWARDS) and "boxed_" in text and "custom_rm_path" in text


LOCAL = sorted(set(BUILTIN_REWARDS) - {"remote_rm", "dapo-genrm"})  # those two need a server or a judge


@pytest.mark.parametrize("rm", [*LOCAL, "boxed_math", "boxed_exact_match", "boxed_boxed_f1", "boxed_dapo"])
def test_builtin_rm_types_pass(rm):
    assert recipe_from_dict({"rollout": {"rm_type": rm}}).rollout.rm_type == rm


@pytest.mark.parametrize("rm", ["dapo", "deepscaler", "multiple_choice", "gpqa", "f1", "random", "remote_rm"])
def test_relax_builtin_names_are_accepted(rm):
    """Relax's built-ins are in BUILTIN_REWARDS, so the validator knows them without a list of its own."""
    r = recipe_from_dict({"rollout": {"rm_type": rm, "rm_url": "http://rm-host:8000/score"}})
    assert r.rollout.rm_type == rm


def test_boxed_of_an_unknown_type_is_refused():
    assert "Fix: use one of" in problems({"rollout": {"rm_type": "boxed_ifbench"}})["rollout.rm_type"]


def test_remote_rm_needs_rm_url():
    text = line(error({"rollout": {"rm_type": "remote_rm"}}), "rollout.rm_url")
    assert "is required with rollout.rm_type remote_rm" in text and "Fix: set rollout.rm_url" in text


@pytest.mark.parametrize("url", ["https://rm.example.org/v1/score", "http://10.0.0.5:8000"])
def test_remote_rm_with_an_http_url_passes(url):
    assert recipe_from_dict({"rollout": {"rm_type": "remote_rm", "rm_url": url}}).rollout.rm_url == url


@pytest.mark.parametrize("url", ["rm-host:8000/score", "ftp://rm-host/score", "http://", "http://a b/score", ""])
def test_rm_url_must_be_http(url):
    text = problems({"rollout": {"rm_type": "remote_rm", "rm_url": url}})["rollout.rm_url"]
    assert "is not an http(s) URL" in text


def test_boxed_remote_rm_is_refused():
    text = problems({"rollout": {"rm_type": "boxed_remote_rm", "rm_url": "http://h/s"}})["rollout.rm_type"]
    assert "has no boxed_ form" in text


def test_relax_rm_url_flag_maps_to_the_recipe_key():
    from relax_hpc.recipe.relax_names import RELAX_NAMES
    assert RELAX_NAMES["rm_url"] == "rollout.rm_url"


def test_rm_type_is_free_with_a_custom_reward_function():
    """The custom function receives args.rm_type and may give it its own meaning."""
    r = recipe_from_dict({"rollout": {"rm_type": "ifbench", "custom_rm_path": "pkg.mod.reward"}})
    assert r.rollout.rm_type == "ifbench"


# --- 6. slurm.env overriding the launcher's variables ------------------------------------------------------

@pytest.mark.parametrize("name", ["SUBMITIT_LOCAL_NTASKS", "SUBMITIT_EXECUTOR", "RELAX_RUN_DIR", "RELAX_RANK",
                                  "RELAX_EXECUTOR", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS",
                                  "SLURM_HET_SIZE", "SLURM_JOB_NODELIST_HET_GROUP_0", "SLURM_RESTART_COUNT",
                                  "SLURM_LOCALID", "SLURMD_NODENAME", "PMIX_RANK"])
def test_launcher_variables_in_slurm_env_are_refused(name):
    text = line(error({"slurm": {"env": {name: "2"}}}), f"slurm.env.{name}")
    assert f"slurm.env.{name} = ***" in text and "launcher" in text and "Fix: remove it from slurm.env" in text


@pytest.mark.parametrize("name", ["SLURM_CONF", "SLURM_MPI_TYPE", "SBATCH_PARTITION", "RELAX_SGLANG_PYTHON",
                                  "RELAX_NOTIFY_URLS", "OMPI_MCA_btl", "NCCL_DEBUG"])
def test_user_variables_in_slurm_env_pass(name):
    assert recipe_from_dict({"slurm": {"env": {name: "x"}}}).slurm.env[name] == "x"


# --- 7. Relax's flag names ---------------------------------------------------------------------------------

@pytest.mark.parametrize("data,key,hint", [
    ({"run": {"num_rollout": 100}}, "run.num_rollout",
     "Relax's --num-rollout is `run.steps` here. Fix: set run.steps: 100"),
    ({"num-rollout": 100}, "num-rollout", "Relax's --num-rollout is `run.steps` here"),
    ({"rollout": {"prompt_data": "d.jsonl"}}, "rollout.prompt_data", "`data.path` here. Fix: set data.path: d.jsonl"),
    ({"hf_checkpoint": "/m"}, "hf_checkpoint", "Relax's --hf-checkpoint is `model.path` here"),
    ({"rollout": {"rollout_max_response_len": 64}}, "rollout.rollout_max_response_len", "`rollout.max_response_len`"),
    ({"rollout": {"rollout-temperature": 0.7}}, "rollout.rollout-temperature",
     "Relax's --rollout-temperature is `rollout.temperature`"),
    ({"data": {"rollout_shuffle": True}}, "data.rollout_shuffle", "`data.shuffle` here. Fix: set data.shuffle: true"),
    ({"data": {"rollout_seed": 7}}, "data.rollout_seed", "`data.seed`"),
    ({"rollout": {"global_batch_size": 64}}, "rollout.global_batch_size", "`train.global_batch_size`"),
    ({"lr": 1e-6}, "lr", "Relax's --lr is `train.lr` here"),
    ({"checkpoint": {"save_interval": 5}}, "checkpoint.save_interval", "`checkpoint.interval`"),
    ({"train": {"advantage_estimator": "gspo"}}, "train.advantage_estimator", "`algorithm.advantage_estimator`"),
    ({"eps_clip": 0.2}, "eps_clip", "Relax's --eps-clip is `algorithm.eps_clip`"),
    ({"train": {"tensor_model_parallel_size": 2}}, "train.tensor_model_parallel_size", "`train.tp`"),
    ({"fully_async": True}, "fully_async", "`mode: fully_async` here. Fix: set mode: fully_async instead"),
    ({"rollout": {"input_key": "q", "label_key": "a"}}, "rollout.input_key", "`data.input_key`"),
])
def test_relax_flag_names_point_at_the_relax_hpc_key(data, key, hint):
    msg = problems(data)[key]
    assert hint in msg and "did you mean" not in msg


def test_relax_flag_hint_shows_the_value():
    assert "run.num_rollout = 100: unknown key; Relax's --num-rollout" in str(error({"run": {"num_rollout": 100}}))


@pytest.mark.parametrize("name", ["num_epoch", "update-weights-interval", "sglang_config", "wandb_key"])
def test_relax_flags_without_a_home_say_so(name):
    msg = problems({"rollout": {name: 1}})[f"rollout.{name}"]
    assert f"Relax's --{name.replace('_', '-')} has no equivalent in relax_hpc yet" in msg and "Fix: remove it" in msg


def test_every_relax_name_maps_to_an_existing_key():
    bad = {n: t for n, t in RELAX_NAMES.items() if t is not None and t.split(":")[0] not in schema_keys()}
    assert bad == {}


def test_same_name_in_another_section_is_pointed_at():
    msg = problems({"rollout": {"tp": 2}})["rollout.tp"]
    assert "train.tp" in msg and "Fix: set train.tp: 2 instead" in msg


def test_typos_still_get_a_spelling_hint():
    assert "did you mean 'runs_root'" in problems({"run": {"runs_rot": "x"}})["run.runs_rot"]


# --- 2. and 4. files the run opens (relax-submit calls these through preflight) -------------------------

def model_dir(tmp_path: Path, **config) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def file_problems(data, cwd) -> dict[str, tuple[object, str]]:
    return {k: (v, m) for k, v, m in check_files(recipe_from_dict(data), cwd)}


def test_missing_data_path_is_refused(tmp_path):
    (value, msg), = file_problems({"data": {"path": "prompts/train.jsonl"}}, tmp_path).values()
    assert value == "prompts/train.jsonl" and "no such file or directory" in msg
    assert str(tmp_path) in msg and "Fix: give an existing JSONL/Parquet file" in msg


def test_custom_config_is_read_at_submit(tmp_path):
    """Relax's --custom-config-path: its own keys are fine; one that contradicts the recipe, or a missing file,
    is refused before submit (the rollout role would refuse it only after the queue)."""
    (tmp_path / "cfg.yaml").write_text("judge_url: http://judge\nn_samples_per_prompt: 8\n")
    assert file_problems({"rollout": {"custom_config_path": "cfg.yaml", "n_samples_per_prompt": 8}}, tmp_path) == {}
    (value, msg), = file_problems({"rollout": {"custom_config_path": "cfg.yaml", "n_samples_per_prompt": 4}},
                                  tmp_path).values()
    assert value == "cfg.yaml" and "n_samples_per_prompt: 8 (the recipe gives 4)" in msg and "Fix:" in msg
    (value, msg), = file_problems({"rollout": {"custom_config_path": "nope.yaml"}}, tmp_path).values()
    assert value == "nope.yaml" and "cannot read" in msg


def test_relative_data_path_is_resolved_against_the_submit_directory(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "train.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    assert file_problems({"data": {"path": "prompts/train.jsonl"}}, tmp_path) == {}
    assert file_problems({"data": {"path": "prompts"}}, tmp_path) == {}  # a directory of files
    assert "data.path" in file_problems({"data": {"path": "prompts/train.jsonl"}}, tmp_path / "prompts")


def test_empty_data_directory_and_missing_eval_set_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    p = file_problems({"data": {"path": str(tmp_path / "empty"), "eval_prompt_data": {"aime": "nope.jsonl"}}}, tmp_path)
    assert "no .jsonl" in p["data.path"][1] and p["data.eval_prompt_data.aime"][0] == "nope.jsonl"


def test_prompt_plus_response_longer_than_the_context_is_refused(tmp_path):
    model_dir(tmp_path, max_position_embeddings=2048)
    data = {"model": {"path": "model"}, "rollout": {"max_prompt_len": 1024, "max_response_len": 1536}}
    (value, msg), = file_problems(data, tmp_path).values()
    assert value == 1536 and "1024 + 1536 = 2560" in msg and "max_position_embeddings = 2048" in msg
    assert "Fix: lower either so that their sum is at most 2048" in msg
    data["rollout"]["max_response_len"] = 1024
    assert file_problems(data, tmp_path) == {}


def test_response_alone_longer_than_the_context_is_refused(tmp_path):
    model_dir(tmp_path, text_config={"max_position_embeddings": 512})
    (value, msg), = file_problems({"model": {"path": "model"}, "rollout": {"max_response_len": 600}}, tmp_path).values()
    assert value == 600 and "max_position_embeddings = 512" in msg and "Fix: at most 512" in msg
    assert file_problems({"model": {"path": "model"}, "rollout": {"max_response_len": 512}}, tmp_path) == {}


def test_context_is_not_checked_without_a_model_config(tmp_path):
    long = {"rollout": {"max_response_len": 10 ** 6}, "train": {"max_seq_len": 2 * 10 ** 6}}
    assert list(file_problems({**long, "model": {"path": "absent"}}, tmp_path)) == ["model.path"]  # only that
    model_dir(tmp_path, hidden_size=8)
    assert file_problems({**long, "model": {"path": "model"}}, tmp_path) == {}


# --- 7. user functions the recipe names (relax-submit loads them through check_files) ----------------------

LOSS_FILE = "def my_loss(batch, cfg):\n    return batch.log_probs, {}\n\ndef one_arg(batch):\n    return batch\n"


def test_custom_loss_file_relative_to_the_submit_directory_is_loaded(tmp_path):
    (tmp_path / "losses").mkdir()
    (tmp_path / "losses" / "mine.py").write_text(LOSS_FILE)
    assert file_problems({"algorithm": {"custom_loss_path": "losses/mine.py:my_loss"}}, tmp_path) == {}
    p = file_problems({"algorithm": {"custom_loss_path": "losses/mine.py:my_loss"}}, tmp_path / "losses")
    assert "there is no file" in p["algorithm.custom_loss_path"][1]


@pytest.mark.parametrize("spec, text", [
    ("losses/mine.py:nope", "has no attribute 'nope'"),
    ("losses/mine.py:one_arg", "one_arg(batch) cannot be called as one_arg(batch, cfg)"),
    ("losses/absent.py:my_loss", "there is no file"),
    ("no_such_pkg_for_tests.losses.my_loss", "cannot import module 'no_such_pkg_for_tests.losses'"),
])
def test_bad_custom_loss_path_is_refused_before_submit(tmp_path, spec, text):
    (tmp_path / "losses").mkdir()
    (tmp_path / "losses" / "mine.py").write_text(LOSS_FILE)
    (value, msg), = file_problems({"algorithm": {"custom_loss_path": spec}}, tmp_path).values()
    assert value == spec and text in msg and "Fix:" in msg


def test_custom_tis_function_signature_is_checked_before_submit(tmp_path):
    (tmp_path / "relax_tis.py").write_text(  # written for Relax's call: args, loss_masks
        "def mis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks):\n    return pg_loss\n")
    data = {"algorithm": {"use_tis": True, "custom_tis_function_path": "relax_tis.py:mis"}}
    (value, msg), = file_problems(data, tmp_path).values()
    assert "loss_mask" in msg and "Fix: define it as def mis(cfg, *, pg_loss" in msg
    data["algorithm"]["custom_tis_function_path"] = "relax_hpc.algo.tis.icepop_function"
    assert file_problems(data, tmp_path) == {}


def test_reward_module_in_the_submit_directory_is_found_like_the_roles_find_it(tmp_path):
    """The roles run ``python -m`` in the submit directory, so a module there is importable; relax-submit's own
    sys.path does not hold that directory, so check_files puts it there while importing."""
    (tmp_path / "my_rewards_for_validate.py").write_text("async def reward(args, sample, **kw):\n    return 1.0\n")
    try:
        assert file_problems({"rollout": {"custom_rm_path": "my_rewards_for_validate.reward"}}, tmp_path) == {}
        p = file_problems({"rollout": {"custom_rm_path": "my_rewards_for_validate.rewrad"}}, tmp_path)
        assert "did you mean 'reward'?" in p["rollout.custom_rm_path"][1]
    finally:
        sys.modules.pop("my_rewards_for_validate", None)


def test_a_dependency_missing_on_the_submit_machine_is_not_refused(tmp_path, caplog):
    """The job may run in a container holding packages this machine lacks: logged, not refused."""
    (tmp_path / "needs_gpu_pkg.py").write_text("import not_installed_here_xyz\ndef my_loss(batch, cfg):\n    pass\n")
    assert file_problems({"algorithm": {"custom_loss_path": "needs_gpu_pkg.py:my_loss"}}, tmp_path) == {}
    assert "not_installed_here_xyz" in caplog.text


def test_get_mismatch_metrics_needs_a_tis_function():
    msg = problems({"algorithm": {"get_mismatch_metrics": True}})["algorithm.get_mismatch_metrics"]
    assert "algorithm.custom_tis_function_path" in msg and "Fix:" in msg
    r = recipe_from_dict({"algorithm": {"get_mismatch_metrics": True,
                                        "custom_tis_function_path": "relax_hpc.algo.tis.vanilla_tis_function"}})
    assert r.algorithm.get_mismatch_metrics


def test_custom_loss_path_reaches_the_algorithm_config():
    r = recipe_from_dict({"algorithm": {"custom_loss_path": "recipes/examples/custom_loss.py:my_loss"}})
    assert r.algorithm.custom_loss_path == "recipes/examples/custom_loss.py:my_loss"
    assert "algorithm.custom_loss_path" in schema_keys()


def test_example_custom_loss_validates_from_the_repository_root():
    repo = Path(__file__).resolve().parents[2]
    data = {"algorithm": {"custom_loss_path": "recipes/examples/custom_loss.py:my_loss"}}
    assert file_problems(data, repo) == {}


def test_mini_batch_sizes_that_do_not_split_the_step_are_refused():
    """The step's 32 samples split into k equal global batches: sizes that do not divide 32, keys that
    disagree, or fewer samples per step than data-parallel ranks fail at validation, not at step 1."""
    ok = {"rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 8}}
    for train in ({"global_batch_size": 32}, {"global_batch_size": 8}, {"num_steps_per_rollout": 4},
                  {"global_batch_size": 8, "num_steps_per_rollout": 4}):
        recipe_from_dict({**ok, "train": train})
    bad = [({"global_batch_size": 64}, "train.global_batch_size", "4 × 8 = 32"),
           ({"global_batch_size": 12}, "train.global_batch_size", "divide"),
           ({"num_steps_per_rollout": 3}, "train.num_steps_per_rollout", "divide"),
           ({"global_batch_size": 8, "num_steps_per_rollout": 2}, "train.num_steps_per_rollout", "disagrees"),
           ({"num_steps_per_rollout": 0}, "train.num_steps_per_rollout", "at least 1")]
    for train, key, why in bad:
        with pytest.raises(RecipeError) as e:
            recipe_from_dict({**ok, "train": train})
        assert key in str(e.value) and why in str(e.value) and "Fix:" in str(e.value), (train, str(e.value))
    many = {**ok, "roles": {"actor": {"tasks_per_node": 4}}, "train": {"num_steps_per_rollout": 16}}
    with pytest.raises(RecipeError) as e:  # 2 samples per step for 4 DP ranks
        recipe_from_dict(many)
    assert "4 data-parallel actor ranks" in str(e.value)


def test_steps_per_rollout_reads_either_key():
    from relax_hpc.train.config import TrainConfig, steps_per_rollout

    assert steps_per_rollout(TrainConfig(), 32) == 1
    assert steps_per_rollout(TrainConfig(global_batch_size=8), 32) == 4
    assert steps_per_rollout(TrainConfig(num_steps_per_rollout=2), 32) == 2


def test_dynamic_sampling_keys_are_checked_before_submission(tmp_path):
    ok = {"rollout": {"rollout_batch_size": 4, "dynamic_sampling_filter_path":
                      "relax_hpc.rollout.dynamic.check_reward_nonzero_std", "over_sampling_batch_size": 8}}
    recipe_from_dict(ok)
    bad = [({"over_sampling_batch_size": 8}, "rollout.over_sampling_batch_size", "only acts with"),
           ({**ok["rollout"], "over_sampling_batch_size": 2}, "rollout.over_sampling_batch_size", "at least"),
           ({**ok["rollout"], "dynamic_sampling_max_rounds": -1}, "rollout.dynamic_sampling_max_rounds", "0 (no limit)"),
           ({"dynamic_sampling_filter_path": "not a path"}, "rollout.dynamic_sampling_filter_path", "must be")]
    for rollout, key, why in bad:
        with pytest.raises(RecipeError) as e:
            recipe_from_dict({"rollout": {"rollout_batch_size": 4, **rollout}})
        assert key in str(e.value) and why in str(e.value), (rollout, str(e.value))
    # a filter that does not load, or takes another call, is refused at submit with the key named
    (tmp_path / "f.py").write_text("def one(samples):\n    return True\n")
    problems = file_problems({"rollout": {"dynamic_sampling_filter_path": "f.py:one"}}, tmp_path)
    assert "rollout.dynamic_sampling_filter_path" in problems
    problems = file_problems({"rollout": {"sample_filter_path": "f.py:nosuch"}}, tmp_path)
    assert "rollout.sample_filter_path" in problems


def test_partial_rollout_keys_are_checked_before_submission():
    ok = {"mode": "fully_async", "max_staleness": 1,
          "rollout": {"rollout_batch_size": 4, "partial_rollout": True, "over_sampling_batch_size": 8,
                      "partial_rollout_max_aborted_count": 2, "mask_offpolicy_in_partial_rollout": True}}
    recipe_from_dict(ok)
    bad = [({"mode": "colocate", "max_staleness": 0}, "rollout.partial_rollout", "fully_async"),
           ({"rollout": {**ok["rollout"], "over_sampling_batch_size": 4}}, "rollout.partial_rollout", "above"),
           ({"rollout": {**ok["rollout"], "over_sampling_batch_size": None}}, "rollout.partial_rollout", "above"),
           ({"rollout": {"rollout_batch_size": 4, "mask_offpolicy_in_partial_rollout": True}},
            "rollout.mask_offpolicy_in_partial_rollout", "only acts with"),
           ({"rollout": {**ok["rollout"], "partial_rollout_max_aborted_count": 0}},
            "rollout.partial_rollout_max_aborted_count", "at least 1"),
           ({"staleness_mode": "fixed"}, "staleness_mode", "timing"),
           ({"staleness_mode": "exact"}, "staleness_mode", "fixed")]
    for change, key, why in bad:
        with pytest.raises(RecipeError) as e:
            recipe_from_dict({**ok, **change})
        assert key in str(e.value) and why in str(e.value), (change, str(e.value))


def test_a_custom_generate_function_is_loaded_and_checked_before_submission(tmp_path):
    (tmp_path / "g.py").write_text("async def generate(args, sample, sampling_params, evaluation=False):\n"
                                   "    return sample\n\ndef two(args, sample):\n    return sample\n")
    assert file_problems({"rollout": {"custom_generate_function_path": "g.py:generate"}}, tmp_path) == {}
    problems = file_problems({"rollout": {"custom_generate_function_path": "g.py:two"}}, tmp_path)
    assert "rollout.custom_generate_function_path" in problems
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"mode": "fully_async", "max_staleness": 1,
                          "rollout": {"rollout_batch_size": 2, "partial_rollout": True, "over_sampling_batch_size": 4,
                                      "custom_generate_function_path": "g.generate"}})
    assert "rollout.partial_rollout" in str(e.value) and "custom_generate_function_path" in str(e.value)


def test_multi_turn_keys_are_checked_before_submission(tmp_path):
    (tmp_path / "env_x.py").write_text("def build_env(sample=None, args=None, **_):\n    return None\n")
    (tmp_path / "env_bad.py").write_text("def make_env():\n    return None\n")
    ok = {"rollout": {"interaction_env_path": "env_x.py", "max_turns": 2}}
    assert file_problems(ok, tmp_path) == {}
    assert "rollout.interaction_env_path" in file_problems({"rollout": {"interaction_env_path": "env_bad.py"}},
                                                           tmp_path)
    for rollout, key in (({"interaction_env_path": "env_x.py", "max_turns": 0}, "rollout.max_turns"),
                         ({"max_turns": 2}, "rollout.max_turns"),
                         ({"env_step_timeout_s": 0}, "rollout.env_step_timeout_s"),
                         ({"turn_truncation": "maybe"}, "rollout.turn_truncation")):
        with pytest.raises(RecipeError) as e:
            recipe_from_dict({"rollout": rollout})
        assert key in str(e.value), (rollout, str(e.value))


def test_lengths_the_trainer_would_refuse_are_refused_with_both_keys_named(tmp_path):
    """A multi-turn sample grows to the context bound, a single-turn one to prompt + response: longer than
    train.max_seq_len, the run failed at its first training step. The bound defaults to train.max_seq_len."""
    env = {"interaction_env_path": "env_x.py", "max_turns": 2}
    msg = problems({"rollout": {**env, "max_context_len": 25}, "train": {"max_seq_len": 16}})["rollout.max_context_len"]
    assert "= 25: is more than train.max_seq_len = 16" in str(error({"rollout": {**env, "max_context_len": 25},
                                                                     "train": {"max_seq_len": 16}}))
    assert "Fix: at most 16, or null" in msg
    recipe_from_dict({"rollout": {**env, "max_context_len": 16}, "train": {"max_seq_len": 16}})
    msg = problems({"rollout": {**env, "max_prompt_len": 16}, "train": {"max_seq_len": 16}})["rollout.max_prompt_len"]
    assert "no room for a response" in msg and "Fix: below 16" in msg
    single = problems({"rollout": {"max_prompt_len": 10, "max_response_len": 8}, "train": {"max_seq_len": 16}})
    assert "10 + 8 = 18 tokens, more than train.max_seq_len = 16" in single["rollout.max_response_len"]
    single = problems({"rollout": {"max_response_len": 16}, "train": {"max_seq_len": 16}})
    assert "leaves no room for a prompt in train.max_seq_len = 16" in single["rollout.max_response_len"]
    recipe_from_dict({"rollout": {"max_prompt_len": 8, "max_response_len": 8}, "train": {"max_seq_len": 16}})
    recipe_from_dict({"rollout": {"max_response_len": 64, "custom_generate_function_path": "g.generate"},
                      "train": {"max_seq_len": 16}})  # the function makes its samples: the trainer's check only
    msg = problems({"rollout": {"max_context_len": 8}})["rollout.max_context_len"]
    assert "only acts with a multi-turn environment" in msg and "Fix:" in msg
    # with only a custom_config_path, its YAML says whether an env is named: read at submit (check_files)
    (tmp_path / "env_x.py").write_text("def build_env(sample=None, args=None, **_):\n    return None\n")
    (tmp_path / "multi.yaml").write_text("rollout_interaction_env_path: env_x.py\nmax_turns: 2\n")
    (tmp_path / "single.yaml").write_text("judge: x\n")
    assert file_problems({"rollout": {"custom_config_path": "multi.yaml", "max_context_len": 8}}, tmp_path) == {}
    got = file_problems({"rollout": {"custom_config_path": "single.yaml", "max_context_len": 8, "max_turns": 2}},
                        tmp_path)
    assert set(got) == {"rollout.max_context_len", "rollout.max_turns"}
    got = file_problems({"rollout": {"custom_config_path": "single.yaml", "max_response_len": 16},
                         "train": {"max_seq_len": 16}}, tmp_path)
    assert "no room for a prompt" in got["rollout.max_response_len"][1]


def test_keys_that_would_do_nothing_are_refused():
    msg = problems({"algorithm": {"kl_coef": 0.01}})["algorithm.kl_coef"]
    assert "would do nothing" in msg and "ignore it" in msg and "algorithm.use_kl_loss: true" in msg
    assert recipe_from_dict({"algorithm": {"kl_coef": 0}}).algorithm.kl_coef == 0  # Relax scripts pass --kl-coef 0
    msg = problems({"algorithm": {"disable_compute_advantages_and_returns": True}})[
        "algorithm.disable_compute_advantages_and_returns"]
    assert "Relax's --disable-compute-advantages-and-returns has no equivalent in relax_hpc yet" in msg


def test_a_genrm_role_needs_its_model_and_a_model_needs_its_role():
    assert "is required with roles.genrm.enabled" in problems({"roles": {"genrm": {"enabled": True}}})["genrm.model_path"]
    text = problems({"genrm": {"model_path": "/m/judge"}})["roles.genrm.enabled"]
    assert "'/m/judge'" in text and "no judge engines" in text
    r = recipe_from_dict({"genrm": {"model_path": "/m/judge"}, "roles": {"genrm": {"enabled": True, "nodes": 2}}})
    assert r.roles.genrm.nodes == 2 and r.genrm.sampling.temperature == 0.2 and r.genrm.sampling.max_response_len == 1024


def test_dapo_genrm_needs_a_judge_and_has_no_boxed_form():
    text = problems({"rollout": {"rm_type": "dapo-genrm"}})["rollout.rm_type"]
    assert "asks a GenRM judge" in text and "roles.genrm.enabled" in text
    judge = {"genrm": {"model_path": "/m/judge"}, "roles": {"genrm": {"enabled": True}}}
    assert recipe_from_dict({**judge, "rollout": {"rm_type": "dapo-genrm"}}).rollout.rm_type == "dapo-genrm"
    text = problems({**judge, "rollout": {"rm_type": "boxed_dapo-genrm"}})["rollout.rm_type"]
    assert "has no boxed_ form" in text


@pytest.mark.parametrize("data,key,text", [
    ({"genrm": {"retries": 0}}, "genrm.retries", "at least 1"),
    ({"genrm": {"request_timeout_s": 0}}, "genrm.request_timeout_s", "more than 0"),
    ({"genrm": {"sampling": {"max_response_len": 0}}}, "genrm.sampling.max_response_len", "more than 0"),
    ({"genrm": {"sampling": {"temperature": -1}}}, "genrm.sampling.temperature", "0 or more"),
    ({"roles": {"genrm": {"share_with": "rollout"}}}, "roles.genrm.share_with", "nodes of their own"),
])
def test_genrm_values(data, key, text):
    assert text in problems(data)[key]


def test_engine_args_pass_except_the_ones_relax_hpc_sets():
    ok = ["--attention-backend", "fa3", "--mem-fraction-static=0.8"]
    assert recipe_from_dict({"rollout": {"engine": {"args": ok}}}).rollout.engine.args == ok
    got = problems({"rollout": {"engine": {"args": ["--mem-fraction-static", "0.8", "--port=31000", "--api-key"]}}})
    assert "sets --port itself" in got["rollout.engine.args[2]"] and "Fix: remove it" in got["rollout.engine.args[2]"]
    assert "the run's API key" in got["rollout.engine.args[3]"] and "rollout.engine.args[0]" not in got


def test_elastic_keys_are_checked_and_spare_nodes_shape_the_rollout_step():
    from relax_hpc.recipe.layout import role_steps

    r = recipe_from_dict({"roles": {"rollout": {"nodes": 3, "elastic": {"initial": 1}}}})
    step = next(s for s in role_steps(r) if s.role == "rollout")
    assert step.nodes == 1 and r.roles.rollout.nodes == 3  # the component holds 3; the role starts on 1
    got = problems({"roles": {"rollout": {"nodes": 2, "elastic": {"initial": 2, "max": 3}}}})
    assert "roles.rollout.nodes - 1 (1)" in got["roles.rollout.elastic.initial"]
    assert "Fix: remove max, and set roles.rollout.nodes: 3" in got["roles.rollout.elastic.max"]
    got = problems({"roles": {"rollout": {"nodes": 3, "elastic": {"initial": 1, "max": 3}}}})  # equal: still refused
    assert list(got) == ["roles.rollout.elastic.max"] and "is not a setting" in got["roles.rollout.elastic.max"]
    assert "only rollout scales" in problems({"roles": {"actor": {"elastic": {"initial": 1}}}})["roles.actor.elastic"]
    got = problems({"rollout": {"elastic": {"drain_timeout_s": 0, "max_engines": 0, "attach": {"extra": ["-p x"]}}}})
    assert "must be > 0" in got["rollout.elastic.drain_timeout_s"]
    assert "below the 1 engines" in got["rollout.elastic.max_engines"]
    assert "one sbatch option" in got["rollout.elastic.attach.extra[0]"]


def test_autoscale_keys_are_checked():
    got = problems({"rollout": {"elastic": {"autoscale": {"enabled": True, "window": 0, "scale_in_idle_ratio": 2}}}})
    assert "reads fully-async signals" in got["rollout.elastic.autoscale.enabled"]
    assert "must be set" in got["rollout.elastic.autoscale.max"]
    assert "1 or more" in got["rollout.elastic.autoscale.window"]
    assert "a share" in got["rollout.elastic.autoscale.scale_in_idle_ratio"]
    ok = {"mode": "fully_async", "rollout": {"elastic": {"autoscale": {"enabled": True, "max": 3}}}}
    assert recipe_from_dict(ok).rollout.elastic.autoscale.max == 3


# --- datasets: the first rows read at submit as the rollout role reads them (issue 28) ------------------------

def test_every_bad_row_of_a_dataset_is_refused_naming_file_line_and_key(tmp_path):
    """check_files reads the datasets: one problem per kind of bad row, under the recipe key of its dataset."""
    (tmp_path / "train.jsonl").write_bytes(b'{"prompt": "1+1=", "label": "2"}\n{"label": "3"}\n[1]\n'
                                           b'{"prompt": "\xff", "label": "1"}\n')
    (tmp_path / "ev.jsonl").write_text('{"prompt": 5, "label": "1"}\n')
    problems = check_files(recipe_from_dict({"data": {"path": "train.jsonl", "eval_prompt_data": {"ev": "ev.jsonl"}}}),
                           tmp_path)
    train, ev = tmp_path / "train.jsonl", tmp_path / "ev.jsonl"
    assert [(k, v, m.split(". Fix")[0]) for k, v, m in problems] == [
        ("data.path", "train.jsonl", f"{train}: line 2: missing key 'prompt' (data.input_key); the record has keys 'label'"),
        ("data.path", "train.jsonl", f'{train}: line 3: each line must be a JSON object ({{"key": value, ...}}), got an array'),
        ("data.path", "train.jsonl", f"{train}: line 4: not UTF-8 (byte 0xff at column 13)"),
        ("data.eval_prompt_data.ev", "ev.jsonl", f"{ev}: line 1: key 'prompt' (data.input_key) must be a string prompt, got int"),
    ]


def test_a_fifo_as_a_dataset_is_refused_without_reading_it(tmp_path):
    import os

    os.mkfifo(tmp_path / "train.jsonl")
    (value, msg), = file_problems({"data": {"path": "train.jsonl"}}, tmp_path).values()
    assert value == "train.jsonl" and "train.jsonl: not a regular file" in msg


# --- values no key takes, and paths of the wrong kind (issue 28) ------------------------------------------------

def typed_keys(want: tuple[type, ...]) -> list[str]:
    """Every recipe key whose type is one of ``want`` (or ``X | None`` of one)."""
    import dataclasses
    import typing

    from relax_hpc.recipe import Recipe

    out = []

    def walk(cls, prefix):
        for name, tp in typing.get_type_hints(cls).items():
            args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
            if dataclasses.is_dataclass(args[0]):
                walk(args[0], f"{prefix}{name}.")
            elif args[0] in want:
                out.append(f"{prefix}{name}")

    walk(Recipe, "")
    return out


def nested(key: str, value) -> dict:
    data: dict = {}
    node = data
    *parts, last = key.split(".")
    for part in parts:
        node = node.setdefault(part, {})
    node[last] = value
    return data


FLOAT_KEYS = typed_keys((float,))


def test_every_float_key_refuses_inf_and_nan():
    """No number key documents inf or nan (temperature=.inf was accepted): the type pass refuses them all."""
    assert len(FLOAT_KEYS) > 30 and "rollout.temperature" in FLOAT_KEYS and "train.lr" in FLOAT_KEYS
    for key in FLOAT_KEYS:
        for bad in (float("inf"), float("-inf"), float("nan")):
            msg = problems(nested(key, bad))[key]
            assert "must be a finite number" in msg and "Fix:" in msg, (key, msg)
        assert "overflows to inf" in problems(nested(key, "1e999"))[key]  # YAML 1.1 reads 1e999 as text
        assert "too large" in problems(nested(key, 10 ** 400))[key]  # float() of it is an OverflowError


def test_inf_nan_and_huge_integers_are_refused_everywhere():
    for key in typed_keys((int,))[:10] + ["slurm.partition", "rollout.stop_token_ids"]:
        assert "finite" in problems(nested(key, float("nan")))[key]
    for value in (2 ** 63, -(2 ** 63), int("f" * 2000, 16)):
        (msg,) = problems({"run": {"steps": value}}).values()
        assert "is too large" in msg
    text = str(error({"run": {"steps": int("f" * 5000, 16)}}))  # too long for Python to print in decimal
    assert "run.steps = <an integer of 20000 bits>" in text


def test_text_that_cannot_be_encoded_is_refused_by_key():
    """A lone surrogate (a \\ud800 escape in YAML, a byte of argv that is not UTF-8) failed at the first
    stat of the path with a UnicodeEncodeError."""
    p = problems({"model": {"path": "/m/\ud800"}, "slurm": {"sbatch_extra": ["--a=\udcff"], "env": {"\udcff": "1"}},
                  "run": {"name": "x\udfff"}})
    assert set(p) == {"model.path", "slurm.sbatch_extra[0]", "slurm.env[\\udcff]", "run.name"}
    assert "cannot be encoded as UTF-8" in p["model.path"]
    assert "\\udcff" in str(error({"bogus\udcff": 1}))  # an unknown key is printed escaped


def test_chat_template_kwargs_take_json_values_only():
    import datetime

    ok = {"genrm": {"sampling": {"chat_template_kwargs": {"enable_thinking": False, "n": [1, {"a": None}]}}}}
    assert recipe_from_dict(ok).genrm.sampling.chat_template_kwargs["n"] == [1, {"a": None}]
    p = problems({"genrm": {"sampling": {"chat_template_kwargs": {"a": float("nan"), "b": datetime.date(2024, 1, 1),
                                                                  "c": [1, {2: 3}]}}}})
    assert set(p) == {"genrm.sampling.chat_template_kwargs.a", "genrm.sampling.chat_template_kwargs.b",
                      "genrm.sampling.chat_template_kwargs.c[1][2]"}


def test_a_model_path_must_be_a_model_directory(tmp_path):
    """model.path=/dev/null was accepted; a file, a FIFO or a directory without config.json too."""
    import os

    model_dir(tmp_path, max_position_embeddings=64)
    (tmp_path / "bare").mkdir()
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("[" * 10000)
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.json")  # reading it would wait for ever
    for path, says in (("/dev/null", "is not a directory"), ("model/config.json", "is not a directory"),
                       ("absent", "there is no directory"), ("bare", "has no config.json"),
                       ("badjson", "is not JSON"), ("fifo", "is not a regular file but a FIFO")):
        for key in ("model.path", "genrm.model_path"):
            data = {**nested(key, path), "roles": {"genrm": {"enabled": key.startswith("genrm")}}}
            (value, msg), = file_problems(data, tmp_path).values()
            assert value == path and says in msg and "Fix: the model's Hugging Face directory" in msg, (path, msg)
    assert file_problems({"model": {"path": "model"}}, tmp_path) == {}


def test_other_paths_of_the_wrong_kind_are_refused(tmp_path):
    import os

    os.mkfifo(tmp_path / "cfg.yaml")
    (value, msg), = file_problems({"rollout": {"custom_config_path": "cfg.yaml"}}, tmp_path).values()
    assert "is not a regular file but a FIFO" in msg
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 100 + "]" * 100)
    (value, msg), = file_problems({"rollout": {"custom_config_path": "deep.yaml"}}, tmp_path).values()
    assert "nested more than 32 levels deep" in msg
    (tmp_path / "file").write_text("x")
    for root in ("file", "file/runs", "/dev/null/runs"):
        (value, msg), = file_problems({"run": {"runs_root": root}}, tmp_path).values()
        assert value == root and "is not a directory" in msg
    assert file_problems({"run": {"runs_root": "new/runs"}}, tmp_path) == {}  # made at submit


@pytest.mark.parametrize("key", ["model.path", "data.path", "slurm.template", "run.runs_root",
                                 "rollout.custom_config_path", "data.eval_prompt_data.aime"])
def test_paths_too_long_to_open_are_refused_by_the_validator(key):
    for path in ("/x/" + "a" * 256, "/a" * 2100):
        assert "too long for a path" in problems(nested(key, path))[key]


def test_too_many_actor_ranks_name_the_actor_size_when_no_batch_key_is_set():
    """roles.actor.nodes=999 was refused as "train.global_batch_size = None", a key the user never set."""
    (key, value, msg), = error({"roles": {"actor": {"nodes": 999}}}).problems
    assert key == "roles.actor.nodes" and value == 999
    assert "999 data-parallel actor ranks" in msg and "64 samples" in msg and "Fix: at most 64 nodes" in msg


def test_engine_kind_and_offload_rules():
    p = problems({"mode": "fully_async", "max_staleness": 1, "rollout": {"engine": {"offload": True}}})
    assert "mode: colocate" in p["rollout.engine.offload"]
    p = problems({"roles": {"actor_fwd": {"enabled": True}}, "rollout": {"engine": {"offload": True}}})
    assert "roles.actor_fwd" in p["rollout.engine.offload"]
    p = problems({"rollout": {"engine": {"kind": "reference", "args": ["--mem-fraction-static", "0.8"]}}})
    assert "kind: reference takes none" in p["rollout.engine.args"]
    p = problems({"rollout": {"engine": {"kind": "vllm"}}})
    assert "rollout.engine.kind" in p
    r = recipe_from_dict({"rollout": {"engine": {"kind": "sglang", "offload": True, "args": ["--mem-fraction-static",
                                                                                            "0.5"]}}})
    assert (r.rollout.engine.kind, r.rollout.engine.offload) == ("sglang", True)
    assert recipe_from_dict({}).rollout.engine.offload is None  # auto: when the engines share the actor's GPU


# --- opd: on-policy distillation (relax_hpc/algo/config.py OPDConfig) --------------------------------------

OPD_SECTION = {"teacher_url": "http://teacher:30000/generate", "kl_coef": 0.0, "loss_coef": 0.5, "only_reward": True}


def test_an_opd_section_turns_it_on_and_enabled_false_keeps_it_off():
    assert recipe_from_dict({"opd": OPD_SECTION}).opd.enabled is True
    assert recipe_from_dict({"opd": {**OPD_SECTION, "enabled": False}}).opd.enabled is False
    assert recipe_from_dict({}).opd is None


def test_an_opd_section_validates_and_its_problems_carry_the_prefix():
    r = recipe_from_dict({"opd": OPD_SECTION})
    assert (r.opd.teacher_url, r.opd.kl_coef, r.opd.loss_coef, r.opd.only_reward) == (
        "http://teacher:30000/generate", 0.0, 0.5, True)
    got = problems({"opd": {"kl_type": "jsd", "loss_coef": 1, "teacher_timeout_s": 0}})
    assert set(got) == {"opd.teacher_url", "opd.loss_coef", "opd.kl_type", "opd.teacher_timeout_s"}
    assert "one of" in problems({"opd": {**OPD_SECTION, "kl_type": "kl"}})["opd.kl_type"]


def test_relax_opd_flags_written_as_keys_point_at_the_opd_section():
    msg = problems({"opd_kl_coef": 0.5})["opd_kl_coef"]
    assert "opd.kl_coef" in msg and "Fix: set opd.kl_coef: 0.5 instead" in msg
    assert "opd.enabled" in problems({"use_opd": True})["use_opd"]


# --- the OPD teacher: roles.teacher (its own engines, opd.teacher_model_path) or opd.teacher_url ---------

TEACHER_ROLE = {"roles": {"teacher": {"enabled": True}}}


def test_the_opd_teacher_is_the_run_s_engines_or_a_server_exactly_one(monkeypatch):
    own = recipe_from_dict({"opd": {"teacher_model_path": "/m/teacher"}, "roles": {"teacher": {"enabled": True,
                                                                                                "nodes": 2}}})
    assert own.opd.teacher_model_path == "/m/teacher" and own.opd.teacher_url is None and own.roles.teacher.nodes == 2
    assert recipe_from_dict({"opd": {"teacher_url": "http://t:30000/generate"}}).roles.teacher.enabled is False
    text = problems({"opd": {}})["opd.teacher_url"]  # neither
    assert "is required when the run has no teacher engines" in text and "roles.teacher.enabled: true" in text
    text = problems({"opd": {"teacher_url": "http://t:30000/generate", "teacher_model_path": "/m/t"},
                     **TEACHER_ROLE})["opd.teacher_url"]  # both
    assert "the run would ask only one" in text and "Fix: remove opd.teacher_url" in text
    text = problems({"opd": {}, **TEACHER_ROLE})["opd.teacher_model_path"]
    assert "is required with roles.teacher.enabled: true" in text and "--teacher-hf-checkpoint" in text
    text = problems({"opd": {"teacher_url": "http://t:30000/generate", "teacher_model_path": "/m/t"}})[
        "roles.teacher.enabled"]
    assert "'/m/t'" in text and "no teacher engines would run" in text
    assert "nodes of their own" in problems({"opd": {"teacher_model_path": "/m/t"}, "roles": {"teacher": {
        "enabled": True, "share_with": "rollout"}}})["roles.teacher.share_with"]
    # top-k selections need both models' top-k in the training step, which the exchange does not carry
    topk = {"teacher_url": "http://t:30000/generate", "kl_type": "jsd", "token_selection": "student_topk",
            "log_prob_top_k": 4}
    text = problems({"opd": topk})["opd.token_selection"]
    assert "teacher's log-prob of each sampled token only" in text and "Fix: token_selection: student_sampled" in text


def test_teacher_engines_without_opd_are_refused():
    for data in (TEACHER_ROLE, {**TEACHER_ROLE, "opd": {"enabled": False, "teacher_model_path": "/m/t"}}):
        got = problems(data)
        assert list(got) == ["roles.teacher.enabled"], got
        assert "no opd section that is on" in got["roles.teacher.enabled"] and "Fix: add opd:" in got[
            "roles.teacher.enabled"]


def test_the_teacher_model_path_must_be_a_model_directory(tmp_path, monkeypatch):
    model_dir(tmp_path, max_position_embeddings=64)
    data = {"opd": {"teacher_model_path": "absent"}, **TEACHER_ROLE}
    (value, msg), = file_problems(data, tmp_path).values()
    assert value == "absent" and "there is no directory" in msg and "Fix: the model's Hugging Face directory" in msg
    assert file_problems({"opd": {"teacher_model_path": "model"}, **TEACHER_ROLE}, tmp_path) == {}



def test_routing_replay_is_refused_with_an_actor_fwd_role():
    """actor_fwd's π_old pass has no engine experts to replay."""
    msg = problems({"train": {"routing_replay": True}, "roles": {"actor_fwd": {"enabled": True}}})
    assert "roles.actor_fwd" in msg["train.routing_replay"] and "Fix:" in msg["train.routing_replay"]


def test_packing_or_pipelining_a_vision_language_model_is_refused_before_submit(tmp_path):
    """A VLM trains in padded micro-batches on one pipeline stage: a packing key (or pp > 1) with a VLM model.path
    is refused by check_files, naming the key, its value and the fix; the actor's build refused it only after the
    queue. The same keys with a text model pass."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("make_tiny_model_r", str(REPO / "tools" / "make-tiny-model"))
    tool = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(tool)
    vlm = tool.make_tiny_model(tmp_path / "vlm", arch="qwen2_5_vl", seed=0)
    text = model_dir(tmp_path, model_type="qwen3")
    packed = {"train": {"max_tokens_per_micro_batch": 512, "logprob_max_tokens_per_micro_batch": 1024, "pp": 2,
                        "max_seq_len": 512}, "roles": {"actor": {"tasks_per_node": 2}}}
    got = file_problems({"model": {"path": str(vlm)}, **packed}, tmp_path)
    assert sorted(got) == ["train.logprob_max_tokens_per_micro_batch", "train.max_tokens_per_micro_batch",
                           "train.pp"], got
    value, msg = got["train.max_tokens_per_micro_batch"]
    assert value == 512 and "vision-language model (model_type 'qwen2_5_vl')" in msg, msg
    assert "Fix: remove train.max_tokens_per_micro_batch" in msg
    assert got["train.logprob_max_tokens_per_micro_batch"][0] == 1024
    assert got["train.pp"][0] == 2 and "Fix: train.pp: 1" in got["train.pp"][1]
    assert file_problems({"model": {"path": str(text)}, **packed}, tmp_path) == {}
    assert file_problems({"model": {"path": str(vlm)}}, tmp_path) == {}


def test_pyxis_env_may_not_change_the_hosts_srun():
    """pyxis reads slurm.container.env from the host srun's own environment: PATH or LD_* there would pick which srun
    (and which libraries) the host runs. Apptainer passes them as APPTAINERENV_*, inside only: allowed there."""
    base = {"image": "nvcr.io/nvidia/pytorch:25.01-py3", "env": {"LD_PRELOAD": "/x.so", "PATH": "/opt/conda/bin"}}
    p = problems({"slurm": {"container": {**base, "runtime": "pyxis"}}})
    assert "host's srun" in p["slurm.container.env.LD_PRELOAD"] and "host's srun" in p["slurm.container.env.PATH"]
    assert recipe_from_dict({"slurm": {"container": {**base, "runtime": "apptainer"}}}).slurm.container.env["PATH"]


def test_lora_adapter_mode_is_refused_where_the_adapters_would_not_be_applied():
    """SGLang takes the adapters (/load_lora_adapter; every request names it) but not with data-parallel replicas in
    one server; actor_fwd takes full weights only."""
    lora = {"train": {"lora": {"mode": "adapter"}}}
    assert recipe_from_dict({**lora, "rollout": {"engine": {"kind": "sglang"}}}).train.lora.mode == "adapter"
    msg = problems({**lora, "rollout": {"engine": {"kind": "sglang", "args": ["--dp-size", "2"]}}})["rollout.engine.args"]
    assert "data-parallel" in msg and "Fix:" in msg
    msg = problems({**lora, "roles": {"actor_fwd": {"enabled": True}}})["train.lora.mode"]
    assert "actor_fwd" in msg and "Fix:" in msg
    assert recipe_from_dict({**lora, "rollout": {"engine": {"kind": "reference"}}}).train.lora.mode == "adapter"
    assert recipe_from_dict({"train": {"lora": {"mode": "merge"}}, "rollout": {"engine": {"kind": "sglang"}}})
    assert recipe_from_dict({**lora, "roles": {"rollout": {"gpus_per_node": 1, "tasks_per_node": 1}}})
    assert recipe_from_dict(lora).train.lora.mode == "adapter"  # CPU engines (auto): the reference engine
