"""relax-submit --from-relax-args: a Relax launch script's flags become a recipe that loads, with every flag either
carried to its key or named in a comment, never dropped silently."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relax_hpc.recipe import load_recipe, recipe_from_dict
from relax_hpc.recipe.from_relax import convert, split_flags

REPO = Path(__file__).resolve().parents[2]
SCRIPT = ("--hf-checkpoint /models/Qwen3-4B --prompt-data /data/dapo.jsonl --input-key prompt --rollout-batch-size 32 "
          "--n-samples-per-prompt 8 --rollout-max-response-len 8192 --num-steps-per-rollout 4 --eps-clip-high 0.28 "
          "--use-kl-loss --fully-async --rollout-stop </answer> STOP --lr 1e-6 --tensor-model-parallel-size 2 "
          "--actor-num-nodes 1 --actor-num-gpus-per-node 8 --rollout-num-gpus 8 --num-epoch 3 --wandb-project x "
          "--dynamic-sampling-filter-path relax.engine.filters.dynamic_sampling_filters.check_reward_nonzero_std "
          "--over-sampling-batch-size 64").split()


def test_split_flags():
    assert split_flags(["--a", "1", "2", "--b=x", "--c"]) == [("--a", ["1", "2"]), ("--b", ["x"]), ("--c", [])]
    with pytest.raises(ValueError, match="before any --flag"):
        split_flags(["stray", "--a"])


def test_flags_land_on_their_keys_with_their_types():
    data, notes = convert(SCRIPT)
    assert data["model"]["path"] == "/models/Qwen3-4B" and data["data"]["input_key"] == "prompt"
    assert data["train"] == {"num_steps_per_rollout": 4, "lr": 1e-6, "tp": 2, "bf16": True, "max_seq_len": 8192 + 4096}
    assert data["rollout"]["stop"] == ["</answer>", "STOP"] and data["mode"] == "fully_async"
    assert data["algorithm"] == {"eps_clip_high": 0.28}  # --use-kl-loss at Relax's kl_loss_coef 0: a term of 0
    assert any(n.startswith("--use-kl-loss: left out, as --kl-loss-coef is 0") for n in notes)
    assert data["rollout"]["dynamic_sampling_filter_path"] == "relax_hpc.rollout.dynamic.check_reward_nonzero_std"
    assert data["roles"]["actor"] == {"nodes": 1, "gpus_per_node": 8, "tasks_per_node": 8}
    assert data["roles"]["rollout"] == {"nodes": 1, "gpus_per_node": 8, "tasks_per_node": 8}  # 8 engines of 1 GPU
    assert data["data"]["label_key"] is None  # Relax's default, which differs from relax_hpc's
    said = "\n".join(notes)
    for flag in ("--num-epoch 3", "--wandb-project x"):
        assert flag in said  # not carried over, and said so
    assert "train.max_seq_len: 12288 = --rollout-max-response-len + 4096 tokens of prompt" in said


def test_max_seq_len_holds_the_longest_sample_the_flags_allow():
    """Relax's trainer takes any length; relax_hpc's refuses a sample over train.max_seq_len, so the recipe says it."""
    got = {tuple(a): convert(a)[0].get("train", {}).get("max_seq_len") for a in (
        ["--rollout-max-response-len", "1024"],  # prompts unbounded: room for the default's worth of them
        ["--rollout-max-prompt-len", "512", "--rollout-max-response-len", "1024"],  # fits the default: left alone
        ["--rollout-max-prompt-len", "2048", "--rollout-max-response-len", "8192"],
        ["--rollout-max-context-len", "32768", "--rollout-max-response-len", "8192"])}
    assert list(got.values()) == [1024 + 4096, None, 2048 + 8192, 32768]


def test_the_command_prints_yaml_that_loads(tmp_path):
    p = subprocess.run([sys.executable, "-m", "relax_hpc.launch.cli", "--from-relax-args", *SCRIPT], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("# recipe made by relax-submit --from-relax-args")
    (tmp_path / "r.yaml").write_text(p.stdout)
    r = load_recipe(tmp_path / "r.yaml")
    assert (r.rollout.rollout_batch_size, r.train.num_steps_per_rollout, r.mode) == (32, 4, "fully_async")

    bad = subprocess.run([sys.executable, "-m", "relax_hpc.launch.cli", "--from-relax-args", "--rollout-batch-size",
                          "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "rollout.rollout_batch_size" in bad.stderr and not bad.stdout


def test_genrm_flags_enable_the_judge_role():
    data, notes = convert(["--rm-type", "dapo-genrm", "--genrm-model-path", "/m/judge", "--genrm-engine-config", "{}"])
    assert data["genrm"] == {"model_path": "/m/judge"} and data["roles"]["genrm"] == {"enabled": True}
    said = "\n".join(notes)
    assert "roles.genrm.enabled: true" in said and "--genrm-engine-config {}: not supported yet" in said


def test_a_single_turn_context_length_becomes_max_seq_len_and_the_recipe_validates():
    """--rollout-max-context-len bounds multi-turn rollouts only here: a single-turn script's is left out (with a
    note), after it sized train.max_seq_len, so the recipe made passes validation."""
    from relax_hpc.recipe.validate import build, check
    from relax_hpc.recipe.schema import Recipe

    data, notes = convert(["--rollout-max-context-len", "8192", "--rollout-max-response-len", "2048"])
    assert "max_context_len" not in data["rollout"] and data["train"]["max_seq_len"] == 8192
    assert any(n.startswith("--rollout-max-context-len: left out") for n in notes)
    problems: list = []
    recipe = build(Recipe, data, "", problems)
    assert not problems and not [p for p in check(recipe) if "max_context_len" in str(p)]


def _validates(data: dict) -> list:
    from relax_hpc.recipe.schema import Recipe
    from relax_hpc.recipe.validate import build, check

    problems: list = []
    recipe = build(Recipe, data, "", problems)
    return problems + check(recipe)


def test_memory_flags_land_on_the_train_keys():
    """Megatron's recompute and sequence-parallel flags, as Relax passes them through; the recipe validates."""
    data, notes = convert("--tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity full "
                          "--recompute-method block --recompute-num-layers 2 --actor-num-gpus-per-node 2".split())
    assert data["train"] == {"tp": 2, "sequence_parallel": True, "recompute": "full", "recompute_method": "block",
                             "recompute_num_layers": 2, "bf16": True}
    assert _validates(data) == []
    assert convert(["--recompute-activations"])[0]["train"]["recompute"] == "selective"  # Megatron's older flag
    assert convert(["--recompute-granularity", "selective"])[0]["train"]["recompute"] == "selective"


def test_sequence_parallel_without_tp_is_left_out_as_megatron_does():
    """Megatron turns --sequence-parallel off at TP 1 (a warning); the recipe would refuse it, so it is left out."""
    data, notes = convert(["--sequence-parallel"])
    assert "sequence_parallel" not in data.get("train", {}) and _validates(data) == []
    assert any(n.startswith("--sequence-parallel: left out") for n in notes)


def test_token_budgets_carry_over_only_with_dynamic_batch_size():
    """Relax reads --max-tokens-per-gpu and --log-probs-max-tokens-per-gpu only with --use-dynamic-batch-size."""
    budgets = ["--max-tokens-per-gpu", "16384", "--log-probs-max-tokens-per-gpu", "32768"]
    data, notes = convert(["--use-dynamic-batch-size", *budgets])
    assert data["train"] == {"max_tokens_per_micro_batch": 16384, "logprob_max_tokens_per_micro_batch": 32768,
                             "bf16": True}
    assert not [n for n in notes if "tokens" in n] and _validates(data) == []
    data, notes = convert(budgets)  # no switch: Relax batches by --micro-batch-size and ignores the budgets
    assert data["train"] == {"bf16": True}
    said = "\n".join(notes)
    for flag in ("--max-tokens-per-gpu 16384", "--log-probs-max-tokens-per-gpu 32768"):
        assert f"{flag}: Relax reads it only with --use-dynamic-batch-size; left out" in said
    data, notes = convert(["--use-dynamic-batch-size"])  # Relax refuses the switch without a budget
    assert data["train"] == {"bf16": True}
    assert any("--use-dynamic-batch-size: without --max-tokens-per-gpu" in n and "train.max_tokens_per_micro_batch"
               in n for n in notes)
    data, _ = convert(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048"])  # below train.max_seq_len
    assert [p[0] for p in _validates(data)] == ["train.max_tokens_per_micro_batch"]


def test_dynamic_batch_size_written_into_a_recipe_points_at_the_budget_key():
    from relax_hpc.recipe.validate import unknown_key_hint

    hint = unknown_key_hint("use_dynamic_batch_size", ["tp"], True)
    assert "--use-dynamic-batch-size is `train.max_tokens_per_micro_batch: <--max-tokens-per-gpu>`" in hint


def test_dynamic_batch_size_drops_the_sample_count_and_keeps_a_guessed_max_seq_len_within_the_budget():
    """A sample must fit one packed micro-batch: a max_seq_len guessed from the response length and the default prompt
    room is cut to the token budget; --micro-batch-size, unused when packing, is left out with a note. The result
    validates."""
    from relax_hpc.train.config import TrainConfig, check

    data, notes = convert(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216", "--rollout-max-response-len",
                           "8192", "--micro-batch-size", "4"])
    tr = data["train"]
    assert tr == {"max_tokens_per_micro_batch": 9216, "bf16": True, "max_seq_len": 9216}
    assert any(n.startswith("--micro-batch-size: left out") for n in notes)
    assert any(n.startswith("train.max_seq_len: 9216 = the token budget") for n in notes)
    assert check(TrainConfig(**tr)) == []


def test_offload_flags_land_on_the_engines_and_the_actor():
    """--offload-rollout: the engines hand their memory over; --offload-train: the actor does (train.offload);
    --offload: both; --colocate implies both in Relax, so the recipe says so unless the script says otherwise."""
    data, notes = convert(["--colocate", "--offload-rollout"])
    assert data["rollout"]["engine"]["offload"] is True and data["mode"] == "colocate", data
    data, notes = convert(["--offload-train"])
    assert "engine" not in (data.get("rollout") or {}) and data["train"]["offload"] is True
    data, _ = convert(["--offload"])
    assert data["rollout"]["engine"]["offload"] is True and data["train"]["offload"] is True
    data, notes = convert(["--colocate"])
    assert data["rollout"]["engine"]["offload"] is True and data["train"]["offload"] is True
    assert any(n.startswith("train.offload: true, as Relax's --colocate implies") for n in notes)
    data, _ = convert(["--fully-async"])
    assert "engine" not in (data.get("rollout") or {}) and "offload" not in data["train"]


def test_wandb_flags_land_in_logging_wandb_only_with_use_wandb():
    data, notes = convert(["--wandb-mode", "offline", "--use-wandb", "--wandb-project", "p", "--wandb-team", "t",
                           "--wandb-group", "g", "--wandb-key", "secret"])
    assert data["logging"]["wandb"] == {"mode": "offline", "project": "p", "entity": "t", "group": "g"}
    assert any(n.startswith("--wandb-key secret: not supported") for n in notes)  # never into the recipe
    assert "secret" not in yaml.safe_dump(data)
    data, _ = convert(["--use-wandb", "--wandb-project", "p"])
    assert data["logging"]["wandb"] == {"mode": "online", "project": "p"}
    recipe_from_dict(data)  # loads, and validates
    data, notes = convert(["--wandb-project", "p"])
    assert "logging" not in data and any("only with --use-wandb" in n for n in notes)


def test_eval_prompt_data_pairs_become_the_mapping():
    data, _ = convert(["--eval-prompt-data", "aime", "/d/aime.jsonl", "math500", "/d/math500.jsonl"])
    assert data["data"]["eval_prompt_data"] == {"aime": "/d/aime.jsonl", "math500": "/d/math500.jsonl"}


OPD_SCRIPT = ["--use-opd", "--opd-type", "sglang", "--opd-teacher-url", "http://teacher:30000/generate",
              "--opd-kl-coef", "0", "--opd-loss-coef", "0.5", "--opd-disable-rl-reward", "--opd-per-token-clip", "5",
              "--opd-log-prob-min-clamp", "-20"]


def test_opd_flags_land_in_the_opd_section():
    data, notes = convert(OPD_SCRIPT)
    assert data["opd"] == {"enabled": True, "teacher_url": "http://teacher:30000/generate", "kl_coef": 0.0,
                           "loss_coef": 0.5, "only_reward": True, "per_token_clip": 5.0, "log_prob_min_clamp": -20}


def test_a_teacher_checkpoint_starts_the_run_s_own_teacher():
    """Relax's --teacher-hf-checkpoint is a managed teacher: opd.teacher_model_path, served by roles.teacher."""
    data, notes = convert(["--use-opd", "--opd-type", "sglang", "--teacher-hf-checkpoint", "/m/teacher",
                           "--opd-disable-rl-reward"])
    assert data["opd"]["teacher_model_path"] == "/m/teacher" and data["roles"]["teacher"] == {"enabled": True}
    assert any(n.startswith("roles.teacher.enabled: true") for n in notes)
    data, notes = convert(["--teacher-hf-checkpoint", "/m/teacher"])  # without --use-opd Relax ignores it
    assert "opd" not in data and "teacher" not in (data.get("roles") or {})


def test_opd_flags_without_use_opd_are_left_out_as_relax_ignores_them():
    data, notes = convert(["--opd-kl-coef", "0.5", "--opd-type", "sglang"])
    assert "opd" not in data
    said = "\n".join(notes)
    assert "--opd-kl-coef 0.5: Relax reads it only with --use-opd" in said and "--opd-type sglang: Relax" in said


def test_a_megatron_teacher_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="--opd-type megatron: .*Fix: serve the teacher with SGLang"):
        convert(["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/ckpt"])


def test_the_opd_recipe_from_flags_is_validated():
    from relax_hpc.recipe import RecipeError, recipe_from_dict

    data, _ = convert(OPD_SCRIPT)
    r = recipe_from_dict(data)
    assert (r.opd.loss_coef, r.opd.per_token_clip, r.opd.log_prob_min_clamp) == (0.5, 5.0, -20.0)
    bad, _ = convert(["--use-opd", "--opd-type", "sglang", "--opd-loss-coef", "0.5"])  # kl_coef stays 1.0
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(bad)
    assert {k for k, _, _ in e.value.problems} == {"opd.teacher_url", "opd.loss_coef"}


def test_one_quoted_string_of_flags_is_split_as_the_shell_would(capsys):
    """``--from-relax-args "--flag a --flag b"`` (as the README writes it) gives the recipe of the words; before,
    the one string was taken for one unknown flag and an empty recipe came out with exit 0."""
    from relax_hpc.launch.cli import submit_main

    assert submit_main(["--from-relax-args", *SCRIPT]) == 0
    words = capsys.readouterr().out
    assert submit_main(["--from-relax-args", " ".join(SCRIPT)]) == 0
    assert capsys.readouterr().out == words and "rollout_batch_size: 32" in words
    assert submit_main(["--from-relax-args", "--lr '1e-6"]) == 2  # an unclosed quote: refused, named
    assert "cannot split" in capsys.readouterr().err
    assert submit_main(["--from-relax-args"]) == 2 and "no flags given" in capsys.readouterr().err


def test_resource_sizes_every_role_and_the_engines():
    """Relax's --resource {role: [1, GPUs]} on nodes of --num-gpus-per-node (8): one rank per GPU for the Megatron
    roles, one task per engine for rollout (TP = --rollout-num-gpus-per-engine). Before, the actor got one rank and
    a TP-2 recipe was refused."""
    data, notes = convert(["--resource", '{"actor": [1, 16], "rollout": [1, 8], "reference": [1, 2]}',
                           "--rollout-num-gpus-per-engine", "4", "--tensor-model-parallel-size", "2", "--fully-async"])
    roles = data["roles"]
    assert roles["actor"] == {"nodes": 2, "gpus_per_node": 8, "tasks_per_node": 8}
    assert roles["rollout"] == {"nodes": 1, "gpus_per_node": 8, "tasks_per_node": 2}  # 2 engines of TP 4
    assert roles["reference"] == {"enabled": True, "nodes": 1, "gpus_per_node": 2, "tasks_per_node": 2}
    assert _validates(data) == []
    data, _ = convert(["--resource", '{"actor": [1, 8], "rollout": [1, 8]}', "--colocate",
                       "--rollout-num-gpus-per-engine", "2", "--tensor-model-parallel-size", "2"])
    assert data["roles"]["rollout"] == {"share_with": "actor", "gpus_per_node": 8, "tasks_per_node": 4}
    assert _validates(data) == []
    data, _ = convert(["--resource", '{"actor": [1, 4]}', "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8"])
    assert data["roles"]["actor"] == {"nodes": 2, "gpus_per_node": 8, "tasks_per_node": 8}  # the flags win, as in Relax
    data, _ = convert(["--resource", '{"actor": [1, 4]}', "--num-gpus-per-node", "2"])
    assert data["roles"]["actor"] == {"nodes": 2, "gpus_per_node": 2, "tasks_per_node": 2}


@pytest.mark.parametrize("argv,said", [
    (["--resource", '{"actor": [1, 12]}'], "12 GPUs do not fill whole nodes of 8"),
    (["--resource", '{"actor": [2, 8]}'], "2 replicas"),
    (["--resource", "{actor: 8}"], "not JSON"),
    (["--resource", '{"actor": [1, 8], "rollout": [1, 8]}', "--rollout-num-gpus-per-engine", "3"],
     "an engine must fit on one node's 8 GPUs"),
    (["--resource", '{"rollout": [1, 16]}', "--rollout-num-gpus-per-engine", "16"], "a divisor of 8"),
])
def test_a_resource_relax_hpc_cannot_lay_out_is_refused_naming_the_fix(argv, said):
    with pytest.raises(ValueError, match=said):
        convert(argv)


def test_ref_actor_config_gives_the_forward_roles_their_own_layout():
    """--ref-actor-config (Relax's overrides for reference and actor_fwd) becomes forward.*; the recipe validates with
    forward roles narrower than the actor (TP 1 against the actor's TP 2) and their own token budget."""
    cfg = '{"tensor_model_parallel_size": 1, "max_tokens_per_gpu": 16384, "sequence_parallel": false, ' \
          '"only_load_weight": true, "recompute_granularity": "full"}'
    data, notes = convert(["--resource", '{"actor": [1, 4], "rollout": [1, 2], "reference": [1, 1], '
                           '"actor_fwd": [1, 1]}', "--ref-actor-config", cfg, "--fully-async",
                           "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-dynamic-batch-size",
                           "--max-tokens-per-gpu", "9216"])
    assert data["forward"] == {"tp": 1, "max_tokens_per_micro_batch": 16384, "sequence_parallel": False}
    assert any(n.startswith("--ref-actor-config only_load_weight: always so") for n in notes)
    assert any(n.startswith("--ref-actor-config recompute_granularity: not supported") for n in notes)
    r = recipe_from_dict(data)
    assert (r.train.tp, r.forward.tp, r.roles.reference.tasks_per_node) == (2, 1, 1)
    data, notes = convert(["--ref-actor-config", cfg, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216"])
    assert "forward" not in data and any("no reference or actor_fwd in --resource" in n for n in notes)
    with pytest.raises(ValueError, match="not JSON"):
        convert(["--resource", '{"reference": [1, 1]}', "--ref-actor-config", "{tp: 1}"])


def test_sglang_flags_become_the_engines_own_arguments():
    data, notes = convert(["--sglang-mem-fraction-static", "0.8", "--sglang-enable-deterministic-inference",
                           "--sglang-router-policy", "round_robin"])
    assert data["rollout"]["engine"] == {"kind": "sglang", "args": ["--mem-fraction-static", "0.8",
                                                                    "--enable-deterministic-inference"]}
    assert any(n.startswith("--sglang-router-policy round_robin: not in relax_hpc's table") for n in notes)


# The flags issue #39 lists from Relax's Qwen3-4B scripts: each maps to a key or is named with the reason
ISSUE_FLAGS = [["--calculate-per-token-loss"], ["--use-dynamic-batch-size", "--log-probs-max-tokens-per-gpu", "8192"],
               ["--use-streaming-dataset"], ["--streaming-buffer-size", "10000"], ["--use-fault-tolerance"],
               ["--use-health-check"], ["--attention-backend", "flash"], ["--accumulate-allreduce-grads-in-fp32"],
               ["--attention-softmax-in-fp32"], ["--warm-hf-checkpoint-page-cache"],
               # megatron-core needs them together (Relax's scripts pass the three)
               ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"],
               ["--megatron-to-hf-mode", "raw"], ["--use-clearml"], ["--use-metrics-service"],
               ["--tb-project-name", "p"], ["--tb-experiment-name", "e"], ["--balance-data"],
               ["--num-iters-per-train-update", "8"]]


@pytest.mark.parametrize("argv", ISSUE_FLAGS, ids=lambda a: a[-1] if a[-1].startswith("--") else a[-2])
def test_each_flag_of_relax_s_scripts_maps_to_a_key_or_is_named_with_the_reason(argv):
    data, notes = convert(argv)
    data.pop("data"), data["train"].pop("bf16")  # what every conversion writes (Relax's defaults)
    if not data["train"]:
        del data["train"]
    flag = argv[-1] if argv[-1].startswith("--") else argv[-2]
    named = [n for n in notes if n.startswith(flag)]
    assert bool(data) != bool(named), (data, named)  # a key, or a note: never both, never neither
    if named:
        reason = named[0].split(": ", 1)[1]
        assert "not in relax_hpc's table" not in reason and reason.split(";")[0] not in ("", "not supported yet")
        assert any(w in reason for w in ("not needed", "not supported", "always", "relax_hpc")), reason
    on_gpus = {"roles": {"actor": {"gpus_per_node": 8, "tasks_per_node": 8}}}  # the optimizer's offload needs GPUs
    assert _validates({**data, **on_gpus}) == []


def test_a_kl_term_gets_a_reference_role_and_a_zero_one_is_left_out():
    base = ["--resource", '{"actor": [1, 8], "rollout": [1, 8]}', "--colocate", "--use-kl-loss"]
    data, notes = convert([*base, "--kl-loss-coef", "0.01"])
    assert data["algorithm"] == {"use_kl_loss": True, "kl_loss_coef": 0.01}
    assert data["roles"]["reference"] == {"enabled": True, "share_with": "actor", "gpus_per_node": 8,
                                          "tasks_per_node": 8}
    assert _validates(data) == []
    data, notes = convert([*base, "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl"])
    assert "algorithm" not in data and "reference" not in data["roles"]


def test_relax_trains_in_bf16_unless_told_fp16():
    assert convert([])[0]["train"] == {"bf16": True}
    data, notes = convert(["--fp16"])
    assert "bf16" not in data.get("train", {}) and any(n.startswith("--fp16: not supported yet") for n in notes)
