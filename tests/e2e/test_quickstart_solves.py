"""The quickstart as a user runs it solves its task: one-digit addition, all 55 sums, by greedy decoding of the
export (docs/quickstart.md). A file of its own: its 100-step run (about 3 minutes) is scheduled apart from the Slurm
tests that share test_quickstart.py's worker."""

from __future__ import annotations

import json
import subprocess

import pytest

from .conftest import REPO, quickstart_overrides

SOLVED = 50  # of the 55 sums, greedy: the quickstart's promise (README, docs/quickstart.md)


@pytest.mark.slow
def test_the_quickstart_solves_the_sums(tmp_path, tiny_model):
    """The default quickstart as a user runs it (``relax-submit --local recipes/quickstart.yaml``, nothing changed
    but where the model and the runs are), then ``relax-export`` and the standard transformers call: greedy
    decoding answers at least 50 of the 55 sums, and the run's own summary (its greedy eval before and after) says
    the same. A model that answers a middle digit everywhere (what the earlier recipe learned) gets 15 or so."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax_hpc.tasks import arith

    bin_ = REPO / ".venv" / "bin"
    p = subprocess.run([str(bin_ / "relax-submit"), "--local", str(REPO / "recipes" / "quickstart.yaml"),
                        *quickstart_overrides(tiny_model, tmp_path / "runs", machinery=False)],
                       cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    [run] = (tmp_path / "runs").glob("quickstart-*")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state"] == "COMPLETED" and summary["steps"] == 100
    assert summary["eval_first_step"] == 0 and summary["eval_last_step"] == 100
    assert summary["eval_first"]["arith"] < 0.2  # a random model: about 1 of 55
    assert summary["eval_last"]["arith"] >= SOLVED / 55, summary
    assert "eval arith pass@1" in p.stdout + p.stderr  # the run's last lines say it
    out = tmp_path / "export"
    e = subprocess.run([str(bin_ / "relax-export"), str(run), str(out)], capture_output=True, text=True, timeout=600)
    assert e.returncode == 0, e.stderr
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    right = 0
    for row in arith.prompts():
        enc = tok(row["prompt"], return_tensors="pt")
        ids = model.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)
        right += tok.decode(ids[0, enc["input_ids"].shape[1]:]).strip() == row["label"]
    assert right >= SOLVED, f"the exported model answers {right} of the 55 sums"
    # the export is the model the run evaluated: its greedy count is the engine's last eval's (one near-tie of
    # logits on a sum the model has not learned may break either way between two float paths)
    assert abs(right - round(summary["eval_last"]["arith"] * 55)) <= 1
    print(f"quickstart: greedy {summary['eval_first']['arith'] * 55:.0f}/55 -> {right}/55, "
          f"{summary['wall_time_s']:.0f} s")
