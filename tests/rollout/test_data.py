"""Prompt datasets from real JSONL/Parquet files, the chat template, and the resumable data cursor."""

import importlib.machinery
import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax_hpc.recipe.schema import DataConfig, RolloutConfig
from relax_hpc.rollout.data import (
    DataError,
    DataKeys,
    PromptDataset,
    RolloutDataSource,
    check_config,
    dataset_from_config,
    data_source_from_config,
    eval_datasets_from_config,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny character-level tokenizer of tools/make-tiny-model (built in memory, no weights)."""
    loader = importlib.machinery.SourceFileLoader("make_tiny_model", str(REPO / "tools" / "make-tiny-model"))
    spec = importlib.util.spec_from_loader("make_tiny_model", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod.build_tokenizer()


def write_jsonl(path, records, raw_lines=()):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return path


RECORDS = [
    {"input": "1+1=", "label": "2", "metadata": {"rm_type": "math", "src": "a"}},
    {"input": "2+3=", "label": "5", "metadata": json.dumps({"src": "b"})},  # metadata as a JSON string
    {"input": "4*4=", "label": "16"},  # no metadata: {}
]
KEYS = DataKeys(input_key="input", label_key="label", metadata_key="metadata")


def test_jsonl(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", RECORDS[:2])
    with open(p, "a") as f:
        f.write("\n")  # blank lines are skipped
    write_jsonl(tmp_path / "more.jsonl", RECORDS[2:])
    ds = PromptDataset([p, tmp_path / "more.jsonl"], keys=KEYS)
    assert [s.prompt for s in ds] == ["1+1=", "2+3=", "4*4="]
    assert [s.label for s in ds] == ["2", "5", "16"]
    assert [s.metadata for s in ds] == [{"rm_type": "math", "src": "a"}, {"src": "b"}, {}]
    assert all(s.tokens == [] for s in ds)  # no tokenizer, no token ids
    # a directory reads its files in name order
    assert [s.prompt for s in PromptDataset(tmp_path, keys=KEYS)] == ["1+1=", "2+3=", "4*4="]


def test_parquet_with_chat_messages(tmp_path, tokenizer):
    table = pa.table({
        "prompt": [[{"role": "user", "content": "1+1="}], [{"role": "user", "content": "9-3="}]],
        "answer": ["2", "6"],
        "extra_info": [{"idx": 0}, {"idx": 1}],
    })
    pq.write_table(table, tmp_path / "d.parquet")
    ds = PromptDataset(tmp_path / "d.parquet", keys=DataKeys("prompt", "answer", "extra_info"),
                       tokenizer=tokenizer, apply_chat_template=True, system_prompt="be brief")
    s = ds[1]
    assert s.prompt == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n9-3=<|im_end|>\n<|im_start|>assistant\n"
    assert s.label == "6" and s.metadata == {"idx": 1}
    assert s.tokens == tokenizer.encode(s.prompt, add_special_tokens=False) and len(s.tokens) > 0


def test_chat_template_on_plain_string_and_kwargs(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"input": "hi", "label": "x"}])
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tokenizer, apply_chat_template=True,
                       apply_chat_template_kwargs={"unused_flag": True})
    assert ds[0].prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_max_prompt_len_filters(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [{"input": "1+1=", "label": "2"}, {"input": "123456789+1=", "label": "x"}])
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tokenizer, max_prompt_len=5)
    assert [s.prompt for s in ds] == ["1+1="] and ds.num_filtered == 1


@pytest.mark.parametrize("records, raw, match", [
    ([{"prompt": "x", "label": "1"}], (), r"d\.jsonl: line 1: missing key 'input' \(data\.input_key\); the record has keys 'prompt', 'label'"),
    ([{"input": "x", "label": "1"}, {"input": "y"}], (), r"d\.jsonl: line 2: missing key 'label' \(data\.label_key\)"),
    ([{"input": "x", "label": "1"}], ("{not json",), r"d\.jsonl: line 2: not valid JSON"),
    ([{"input": "x", "label": "1", "metadata": [1]}], (), r"line 1: key 'metadata' \(data\.metadata_key\) must be a mapping"),
    ([{"input": [{"role": "user", "content": "x"}], "label": "1"}], (), r"line 1: key 'input' holds chat messages; set data\.apply_chat_template"),
    ([{"input": 5, "label": "1"}], (), r"line 1: key 'input' must be a string prompt, got int"),
    ([], ("[1, 2]",), r"line 1: each line must be a JSON object"),
])
def test_jsonl_errors_name_file_line_and_key(tmp_path, records, raw, match):
    write_jsonl(tmp_path / "d.jsonl", records, raw)
    with pytest.raises(DataError, match=match):
        PromptDataset(tmp_path / "d.jsonl", keys=KEYS)


def test_parquet_error_names_row(tmp_path):
    pq.write_table(pa.table({"input": ["a", "b", "c"], "label": ["1", None, "3"], "other": [1, 2, 3]}),
                   tmp_path / "d.parquet")
    # a null label is a value (None), not a missing key; a missing column is an error on row 0
    assert [s.label for s in PromptDataset(tmp_path / "d.parquet", keys=KEYS)] == ["1", None, "3"]
    with pytest.raises(DataError, match=r"d\.parquet: row 0: missing key 'question' \(data\.input_key\)"):
        PromptDataset(tmp_path / "d.parquet", keys=DataKeys(input_key="question"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read as Parquet"):
        PromptDataset(tmp_path / "bad.parquet", keys=KEYS)


def test_missing_file_and_tokenizer_needed(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        PromptDataset(tmp_path / "nope.jsonl")
    write_jsonl(tmp_path / "d.jsonl", RECORDS)
    with pytest.raises(DataError, match="apply_chat_template needs a tokenizer"):
        PromptDataset(tmp_path / "d.jsonl", keys=KEYS, apply_chat_template=True)


def _dataset(tmp_path, n=10):
    write_jsonl(tmp_path / "d.jsonl", [{"input": f"q{i}", "label": str(i)} for i in range(n)])
    return PromptDataset(tmp_path / "d.jsonl", keys=KEYS)


def test_groups_are_independent_copies_with_ids(tmp_path):
    src = RolloutDataSource(_dataset(tmp_path, 3), rollout_batch_size=2, n_samples_per_prompt=3)
    groups = src.get_samples()
    assert [[s.index for s in g] for g in groups] == [[0, 1, 2], [3, 4, 5]]
    assert [[s.group_index for s in g] for g in groups] == [[0, 0, 0], [1, 1, 1]]
    assert [g[0].prompt for g in groups] == ["q0", "q1"]
    groups[0][0].metadata["x"] = 1
    assert groups[0][1].metadata == {} and src.dataset[0].metadata == {}
    # past the end of the epoch: the next epoch starts, ids keep counting
    g2 = src.get_samples()
    assert [g[0].prompt for g in g2] == ["q2", "q0"] and src.epoch == 1 and src.offset == 1
    assert g2[1][0].index == 9 and g2[1][0].group_index == 3


def test_shuffle_is_deterministic_per_seed_and_epoch(tmp_path):
    ds = _dataset(tmp_path, 10)

    def prompts(seed, n_batches):
        src = RolloutDataSource(ds, rollout_batch_size=5, shuffle=True, seed=seed)
        return [[g[0].prompt for g in src.get_samples()] for _ in range(n_batches)]

    a = prompts(7, 4)
    assert a == prompts(7, 4)
    assert a != prompts(8, 4)
    epoch0, epoch1 = a[0] + a[1], a[2] + a[3]
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"q{i}" for i in range(10))  # each epoch: every prompt once
    assert epoch0 != epoch1  # reshuffled per epoch
    assert epoch0 != [f"q{i}" for i in range(10)]


def test_cursor_save_restore_resumes_identically(tmp_path):
    ds = _dataset(tmp_path, 7)
    ref = RolloutDataSource(ds, rollout_batch_size=3, n_samples_per_prompt=2, shuffle=True, seed=1)
    run = RolloutDataSource(ds, rollout_batch_size=3, n_samples_per_prompt=2, shuffle=True, seed=1)
    expected = [[(s.prompt, s.index, s.group_index) for g in ref.get_samples() for s in g] for _ in range(6)]
    got = [[(s.prompt, s.index, s.group_index) for g in run.get_samples() for s in g] for _ in range(3)]
    run.save(tmp_path / "state" / "data.json")
    state = json.loads((tmp_path / "state" / "data.json").read_text())
    assert state["epoch"] == 1 and state["offset"] == 2 and state["sample_index"] == 18
    resumed = RolloutDataSource(ds, rollout_batch_size=3, n_samples_per_prompt=2, shuffle=True, seed=1)
    resumed.load(tmp_path / "state" / "data.json")
    got += [[(s.prompt, s.index, s.group_index) for g in resumed.get_samples() for s in g] for _ in range(3)]
    assert got == expected


def test_cursor_refuses_other_dataset_or_seed(tmp_path):
    src = RolloutDataSource(_dataset(tmp_path, 7), rollout_batch_size=3, shuffle=True, seed=1)
    src.get_samples()
    state = src.state_dict()
    (tmp_path / "other").mkdir()
    other = RolloutDataSource(_dataset(tmp_path / "other", 8), rollout_batch_size=3, shuffle=True, seed=1)
    with pytest.raises(DataError, match="num_prompts = 7, this run has 8"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="seed = 1, this run has 2"):
        RolloutDataSource(src.dataset, rollout_batch_size=3, shuffle=True, seed=2).load_state_dict(state)


def test_from_recipe_sections(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "1"}, {"prompt": "b", "label": "2"}])
    data = DataConfig(path=str(tmp_path / "d.jsonl"), shuffle=True)
    roll = RolloutConfig(n_samples_per_prompt=2, rollout_batch_size=2)
    src = data_source_from_config(dataset_from_config(data, roll), data, roll, run_seed=5)
    assert src.seed == 5 and src.shuffle and len(src) == 2
    assert sum(len(g) for g in src.get_samples()) == 4
    write_jsonl(tmp_path / "e.jsonl", [{"q": "c", "a": "3"}])
    data.eval_prompt_data = {"heldout": str(tmp_path / "e.jsonl")}
    data.eval_input_key, data.eval_label_key = "q", "a"
    (ev,) = eval_datasets_from_config(data, roll).items()
    assert ev[0] == "heldout" and (ev[1][0].prompt, ev[1][0].label) == ("c", "3")


def test_check_config():
    assert check_config(DataConfig(), RolloutConfig()) == []
    bad = check_config(
        DataConfig(apply_chat_template_kwargs="{nope"),
        RolloutConfig(n_samples_per_prompt=0, custom_rm_path="my_mod reward", eval_interval=5, top_p=0.0),
    )
    keys = {k for k, _, _ in bad}
    assert keys == {"rollout.n_samples_per_prompt", "rollout.custom_rm_path", "data.eval_prompt_data",
                    "rollout.top_p", "data.apply_chat_template_kwargs"}
    msg = dict((k, m) for k, _, m in bad)["rollout.custom_rm_path"]
    assert "package.module.function" in msg
