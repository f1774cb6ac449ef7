"""relax-submit --dry-run reads the datasets as the rollout role will: every bad dataset of issue 28 is refused
(exit 2) with the file, the line or row and the key, before anything is created or submitted."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax_hpc.launch.cli import submit_main

REPO = Path(__file__).resolve().parents[2]
GOOD = {"prompt": "1+1=", "label": "2"}


def jsonl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def parquet(path: Path, **columns) -> None:
    pq.write_table(pa.table(columns), path)


CASES = {  # name: (file name, its contents (bytes, or a function writing it), extra overrides, words the error has)
    "empty file": ("d.jsonl", b"", [], ["d.jsonl: empty: no records"]),
    "only blank lines": ("d.jsonl", b"\n\n \n", [], ["d.jsonl: empty: no records (only blank lines)"]),
    "a row without the input key": ("d.jsonl", jsonl(GOOD, {"question": "x", "label": "1"}), [],
                                    ["d.jsonl: line 2: missing key 'prompt' (data.input_key)"]),
    "a non-UTF-8 byte": ("d.jsonl", jsonl(GOOD, b'{"prompt": "caf\xe9", "label": "1"}'), [],
                         ["d.jsonl: line 2: not UTF-8 (byte 0xe9"]),
    "a row that is an array": ("d.jsonl", jsonl(GOOD, GOOD, [GOOD]), [],
                               ["d.jsonl: line 3: each line must be a JSON object", "got an array"]),
    "a row that is not JSON": ("d.jsonl", jsonl(b"{'prompt': 'x'}"), [], ["d.jsonl: line 1: not valid JSON"]),
    "a prompt of the wrong type": ("d.jsonl", jsonl({"prompt": ["x"], "label": "1"}), [],
                                   ["d.jsonl: line 1: key 'prompt' (data.input_key) must be a string prompt, got list"]),
    "a row without the label key": ("d.jsonl", jsonl(GOOD, {"prompt": "x"}), [],
                                    ["d.jsonl: line 2: missing key 'label' (data.label_key)"]),
    "all prompts over max_prompt_len": ("d.jsonl", jsonl(*[{"prompt": "123456789+1=", "label": "x"}] * 3),
                                        ["rollout.max_prompt_len=4", "model.path=model"],
                                        ["all 3 prompts checked are longer than rollout.max_prompt_len = 4 tokens",
                                         "d.jsonl: lines 1, 2, 3"]),
    "a Parquet column of the wrong type": ("d.parquet", lambda p: parquet(p, prompt=[1, 2], label=["1", "2"]), [],
                                           ["d.parquet: rows 0, 1: key 'prompt' (data.input_key) must be a string "
                                            "prompt, got int"]),
    "a file that is not Parquet": ("d.parquet", jsonl(GOOD), [], ["d.parquet: cannot read as Parquet"]),
    "an eval set with a bad row": ("ev.jsonl", jsonl({"q": "x", "label": "1"}), [],
                                   ["data.eval_prompt_data.ev = 'ev.jsonl'", "ev.jsonl: line 1: missing key 'prompt'"]),
}


@pytest.fixture
def submit_dir(tmp_path, monkeypatch):
    """A directory to submit from: the recipe (data.path: d.jsonl, or the case's file) and the tiny tokenizer."""
    loader = importlib.machinery.SourceFileLoader("make_tiny_model", str(REPO / "tools" / "make-tiny-model"))
    spec = importlib.util.spec_from_loader("make_tiny_model", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    mod.build_tokenizer().save_pretrained(tmp_path / "model")  # tokenizer.json: what the length check reads
    (tmp_path / "model" / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def dry_run(where: Path, data_file: str, *overrides: str) -> int:
    (where / "r.yaml").write_text(f"run:\n  name: t\n  runs_root: {where / 'runs'}\ndata:\n  path: {data_file}\n")
    return submit_main(["--dry-run", "--local", "r.yaml", *overrides])


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_dataset_is_refused_at_dry_run_with_file_line_and_key(submit_dir, capsys, case):
    name, contents, overrides, words = CASES[case]
    path = submit_dir / name
    contents(path) if callable(contents) else path.write_bytes(contents)
    if name == "ev.jsonl":
        (submit_dir / "d.jsonl").write_bytes(jsonl(GOOD))
        overrides = [*overrides, "data.eval_prompt_data.ev=ev.jsonl"]
        data_file = "d.jsonl"
    else:
        data_file = name
    assert dry_run(submit_dir, data_file, *overrides) == 2
    out, err = capsys.readouterr()
    assert "is invalid (1 problem); nothing was submitted" in err and "Traceback" not in err and out == ""
    line = next((ln for ln in err.splitlines() if words[0] in ln), None)
    assert line is not None, err
    assert line.startswith(("  - data.path = ", "  - data.eval_prompt_data.ev = ")) and str(submit_dir) in line
    assert all(w in err for w in words), err
    assert not (submit_dir / "runs").exists()  # nothing created


def test_a_good_dataset_passes_and_what_is_only_skipped_is_said(submit_dir, capsys, caplog):
    """Blank lines are skipped (as the run skips them), not refused: the dry run goes through and says which;
    so are prompts over max_prompt_len while some remain."""
    (submit_dir / "d.jsonl").write_bytes(jsonl(GOOD, b"", {"prompt": "123456789+1=", "label": "x"}, GOOD))
    with caplog.at_level(logging.WARNING, logger="relax_hpc.recipe.validate"):
        assert dry_run(submit_dir, "d.jsonl", "rollout.max_prompt_len=5", "model.path=model") == 0
    d = submit_dir / "d.jsonl"
    assert [r.getMessage() for r in caplog.records] == [
        f"data.path: {d}: 1 blank line(s) will be skipped (line 2)",
        f"data.path: 1 of the 3 prompts checked are longer than rollout.max_prompt_len = 5 tokens and will be "
        f"dropped ({d}: line 3)"]
    assert "relax-submit --dry-run: nothing submitted" in capsys.readouterr().out
