"""Prompt datasets from real JSONL/Parquet files, the chat template, and the resumable data cursor."""

import importlib.machinery
import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax_hpc.rollout.config import DataConfig, RolloutConfig
from relax_hpc.rollout.data import (
    DataCheck,
    DataError,
    DataKeys,
    PromptDataset,
    RolloutDataSource,
    check_data_files,
    check_dataset,
    dataset_from_config,
    data_source_from_config,
    eval_datasets_from_config,
    token_counter,
)
from relax_hpc.rollout.checks import check_data
from relax_hpc.rollout.sample import Sample

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
    ([{"input": [{"role": "user", "content": "x"}], "label": "1"}], (), r"line 1: key 'input' \(data\.input_key\) holds chat messages; set data\.apply_chat_template"),
    ([{"input": 5, "label": "1"}], (), r"line 1: key 'input' \(data\.input_key\) must be a string prompt, got int"),
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


def test_check_data():
    assert check_data(DataConfig(), RolloutConfig()) == []
    bad = check_data(
        DataConfig(apply_chat_template_kwargs="{nope"),
        RolloutConfig(n_samples_per_prompt=0, custom_rm_path="my_mod reward", eval_interval=5, top_p=0.0),
    )
    keys = {k for k, _, _ in bad}
    assert keys == {"rollout.n_samples_per_prompt", "rollout.custom_rm_path", "data.eval_prompt_data",
                    "rollout.top_p", "data.apply_chat_template_kwargs"}
    msg = dict((k, m) for k, _, m in bad)["rollout.custom_rm_path"]
    assert "package.module.function" in msg


# ----------------------------------------------------------------------------------- reading at run time ---

def test_non_utf8_at_run_time_is_a_permanent_error_naming_file_and_line(tmp_path):
    from relax_hpc.errors import is_permanent

    p = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    with open(p, "ab") as f:
        f.write(b'{"input": "caf\xe9", "label": "1"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl: line 4: not UTF-8 \(byte 0xe9 at column 15\)\. Fix: re-encode") as e:
        PromptDataset(p, keys=KEYS)
    assert is_permanent(e.value)
    p.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in RECORDS).encode())  # a UTF-8 BOM: fine
    assert [s.prompt for s in PromptDataset(p, keys=KEYS)] == ["1+1=", "2+3=", "4*4="]


def test_dropped_and_skipped_rows_are_logged_once_with_their_lines_and_counted(tmp_path, tokenizer, caplog):
    p = write_jsonl(tmp_path / "d.jsonl", [{"input": "1+1=", "label": "2"}, {"input": "123456789+1=", "label": "x"}],
                    raw_lines=["", "   ", json.dumps({"input": "99999999*9=", "label": "y"}), json.dumps(RECORDS[2])])
    with caplog.at_level("WARNING", logger="relax_hpc.rollout.data"):
        ds = PromptDataset(p, keys=KEYS, tokenizer=tokenizer, max_prompt_len=5)
    assert [s.prompt for s in ds] == ["1+1=", "4*4="] and ds.num_filtered == 2 and ds.num_blank == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"{p}: 2 blank line(s) skipped (lines 3, 4)",
        f"{p}: 2 of 4 prompts dropped: longer than rollout.max_prompt_len = 5 tokens (lines 2, 5)"]
    src = RolloutDataSource(ds, rollout_batch_size=1)
    assert src.metrics() == {"rollout/data_dropped/too_long": 2.0, "rollout/data_dropped/blank_line": 2.0}
    src.get_samples()
    assert src.metrics()["rollout/data_dropped/too_long"] == 2.0  # a count of the data, not of the step
    assert RolloutDataSource([Sample(prompt="x")], rollout_batch_size=1).metrics()["rollout/data_dropped/too_long"] == 0


def test_a_fifo_as_data_path_is_refused_not_read(tmp_path):
    import os

    os.mkfifo(tmp_path / "d.jsonl")
    with pytest.raises(DataError, match=r"d\.jsonl: not a regular file"):
        PromptDataset(tmp_path / "d.jsonl", keys=KEYS)


# ------------------------------------------------------------------------------- the check before submit ---

def _check(path, **kw):
    kw.setdefault("keys", KEYS)
    return check_dataset(path, **kw)


def test_check_reports_every_problem_at_once_with_file_line_and_key(tmp_path):
    """Each bad row of the first rows, not only the first: grouped by problem with its lines; a record the run
    would accept is no problem."""
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"\n".join([
        json.dumps(RECORDS[0]).encode(),
        json.dumps({"prompt": "x", "label": "1"}).encode(),        # line 2: no input key
        b'{"input": "caf\xe9", "label": "1"}',                      # line 3: not UTF-8
        b"[1, 2]",                                                  # line 4: an array
        b'"just a string"',                                         # line 5: a string
        b"{not json",                                               # line 6
        json.dumps({"input": 7, "label": "1"}).encode(),           # line 7: wrong type
        json.dumps({"input": "y"}).encode(),                       # line 8: no label
        json.dumps({"prompt": "z", "label": "1"}).encode(),        # line 9: no input key again
        json.dumps({"input": "ok", "label": "1", "metadata": 5}).encode(),  # line 10
    ]) + b"\n")
    res = _check(p)
    assert res.notes == []
    assert res.problems == [
        f"{p}: lines 2, 9: missing key 'input' (data.input_key); the record has keys 'prompt', 'label'. "
        "Fix: set data.input_key to the field that holds the prompt",
        f"{p}: line 3: not UTF-8 (byte 0xe9 at column 15). Fix: re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        f"{p}: line 4: each line must be a JSON object ({{\"key\": value, ...}}), got an array",
        f"{p}: line 5: each line must be a JSON object ({{\"key\": value, ...}}), got a string",
        f"{p}: line 6: not valid JSON (Expecting property name enclosed in double quotes at column 2)",
        f"{p}: line 7: key 'input' (data.input_key) must be a string prompt, got int",
        f"{p}: line 8: missing key 'label' (data.label_key); the record has keys 'input'. "
        "Fix: set data.label_key to the field that holds the label, or null for none",
        f"{p}: line 10: key 'metadata' (data.metadata_key) must be a mapping, got int",
    ]


def test_check_empty_and_blank(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert _check(tmp_path / "empty.jsonl").problems == [f"{tmp_path / 'empty.jsonl'}: empty: no records"]
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    assert _check(tmp_path / "blank.jsonl").problems == [
        f"{tmp_path / 'blank.jsonl'}: empty: no records (only blank lines)"]
    # blank lines are skipped, as the run skips them: a note naming them, not a refusal
    p = write_jsonl(tmp_path / "d.jsonl", RECORDS[:1], raw_lines=["", json.dumps(RECORDS[1])])
    res = _check(p)
    assert res.problems == [] and res.notes == [f"{p}: 1 blank line(s) will be skipped (line 2)"]
    # an empty file among others: the run reads the others
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "a.jsonl", RECORDS)
    (tmp_path / "sub" / "b.jsonl").write_bytes(b"")
    res = _check(tmp_path / "sub")
    assert res.problems == [] and res.notes == [f"{tmp_path / 'sub' / 'b.jsonl'}: empty: no records"]


def test_check_parquet_not_parquet_and_wrong_column_type(tmp_path):
    (tmp_path / "bad.parquet").write_text('{"input": "x"}\n')
    (msg,) = _check(tmp_path / "bad.parquet").problems
    assert msg.startswith(f"{tmp_path / 'bad.parquet'}: cannot read as Parquet (")
    pq.write_table(pa.table({"input": [1, 2, 3], "label": ["a", "b", "c"]}), tmp_path / "d.parquet")
    assert _check(tmp_path / "d.parquet").problems == [
        f"{tmp_path / 'd.parquet'}: rows 0, 1, 2: key 'input' (data.input_key) must be a string prompt, got int"]
    pq.write_table(pa.table({"question": ["a"] * 30, "label": ["a"] * 30}), tmp_path / "d.parquet")
    assert _check(tmp_path / "d.parquet").problems == [
        f"{tmp_path / 'd.parquet'}: rows 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and 20 more: missing key 'input' (data.input_key); "
        "the record has keys 'question', 'label'. Fix: set data.input_key to the field that holds the prompt"]
    pq.write_table(pa.table({"input": ["a"] * 3, "label": ["a"] * 3}), tmp_path / "d.parquet")
    assert _check(tmp_path / "d.parquet") == DataCheck()
    pq.write_table(pa.table({"input": pa.array([], pa.string()), "label": pa.array([], pa.string())}),
                   tmp_path / "d.parquet")
    assert _check(tmp_path / "d.parquet").problems == [f"{tmp_path / 'd.parquet'}: empty: no records"]


def test_check_prompt_lengths(tmp_path, tokenizer):
    """All checked prompts over max_prompt_len: refused (the run would have none); some: a note with the count
    and lines. Counted as the run counts them (the same ids as the run's tokenizer)."""
    def count(text):
        return len(tokenizer.encode(text, add_special_tokens=False))

    p = write_jsonl(tmp_path / "d.jsonl", [{"input": "123456789+1=", "label": "x"}, {"input": "99999*9=", "label": "y"}])
    (msg,) = _check(p, max_prompt_len=5, count_tokens=count).problems
    assert msg == (f"all 2 prompts checked are longer than rollout.max_prompt_len = 5 tokens: every one would be "
                   f"dropped ({p}: lines 1, 2). Fix: raise rollout.max_prompt_len, or shorten the prompts")
    write_jsonl(p, [{"input": "123456789+1=", "label": "x"}, {"input": "1+1=", "label": "y"}])
    res = _check(p, max_prompt_len=5, count_tokens=count)
    assert res.problems == [] and res.notes == [
        f"1 of the 2 prompts checked are longer than rollout.max_prompt_len = 5 tokens and will be dropped ({p}: line 1)"]
    # with the chat template (not applied before submit): the messages' text, a lower bound
    write_jsonl(p, [{"input": [{"role": "user", "content": "123456789+1="}], "label": "x"}])
    (msg,) = _check(p, max_prompt_len=5, count_tokens=count, apply_chat_template=True).problems
    assert "longer than rollout.max_prompt_len = 5 tokens (without the chat template)" in msg
    # only the first rows are read: said when a file has more
    write_jsonl(p, [{"input": "123456789+1=", "label": "x"}] * 5)
    (msg,) = _check(p, max_prompt_len=5, count_tokens=count, rows=3).problems
    assert "all 3 prompts checked" in msg and "the first 3 rows of each file were checked" in msg


def test_token_counter_counts_as_the_runs_tokenizer(tmp_path, tokenizer):
    """Before submit the tokens are counted with the ``tokenizers`` library alone (no transformers, no torch):
    the same count as the run's tokenizer."""
    tokenizer.save_pretrained(tmp_path / "model")
    count, why = token_counter(tmp_path / "model")
    assert why is None
    for text in ("1+1=", "<|im_start|>user\nhi<|im_end|>", "ünïcödé 12345"):
        assert count(text) == len(tokenizer.encode(text, add_special_tokens=False))
    assert token_counter(tmp_path / "nope")[0] is None and "tokenizer.json" in token_counter(tmp_path / "nope")[1]
    assert token_counter(None) == (None, "model.path is not set")


def test_check_data_files_uses_each_datasets_keys(tmp_path, tokenizer):
    """data.path with input_key/label_key, the eval sets with eval_input_key/eval_label_key, the lengths with
    the model's tokenizer (or a note where there is none)."""
    write_jsonl(tmp_path / "train.jsonl", [{"q": "1+1=", "a": "2"}])
    write_jsonl(tmp_path / "ev.jsonl", [{"question": "2+2=", "a": "4"}, {"q": "3+3=", "a": "6"}])
    data = DataConfig(path="train.jsonl", input_key="q", label_key="a", eval_prompt_data={"ev": "ev.jsonl"},
                      eval_input_key="question")
    files = {"data.path": tmp_path / "train.jsonl", "data.eval_prompt_data.ev": tmp_path / "ev.jsonl"}
    problems, notes = check_data_files(data, RolloutConfig(), files, None)
    assert problems == [("data.eval_prompt_data.ev", f"{tmp_path / 'ev.jsonl'}: line 2: missing key 'question' "
                         "(data.eval_input_key); the record has keys 'q', 'a'. Fix: set data.eval_input_key to the "
                         "field that holds the prompt")] and notes == []
    roll = RolloutConfig(max_prompt_len=2)
    problems, notes = check_data_files(data, roll, {"data.path": tmp_path / "train.jsonl"}, tmp_path / "none")
    assert problems == [] and notes == [f"prompt lengths not checked against rollout.max_prompt_len: no "
                                        f"{tmp_path / 'none' / 'tokenizer.json'} (a local fast tokenizer) to count "
                                        "prompt tokens with"]
    tokenizer.save_pretrained(tmp_path / "model")
    problems, notes = check_data_files(data, roll, {"data.path": tmp_path / "train.jsonl"}, tmp_path / "model")
    assert [k for k, _ in problems] == ["data.path"] and "all 1 prompts checked are longer" in problems[0][1]
