"""relax-status of a run in ``slurm.layout: single``: one plain Slurm job (no het components), shown the way Slurm
names it (``J``, not ``J+0``), the one component holding every role. Slurm's rows are squeue's own text
(``squeue --format``), read by relax_hpc's parser as relax-status reads them."""

from __future__ import annotations

import io
import time

from rich.console import Console

from relax_hpc.launch import slurm, status
from relax_hpc.recipe import dump_recipe, recipe_from_dict
from relax_hpc.rundir import create_run_dir, write_json, write_private

ROLES = {"actor": {"nodes": 2}, "rollout": {"nodes": 1}, "reference": {"enabled": True, "share_with": "actor",
                                                                       "nodes": 1}}


def run_dir(tmp_path, layout: str):
    rd = create_run_dir(tmp_path / "runs", "st")
    write_private(rd.recipe, dump_recipe(recipe_from_dict({"run": {"name": "st"}, "roles": ROLES,
                                                           "slurm": {"layout": layout}})))
    write_json(rd.job, {"run": rd.name, "run_dir": str(rd.path), "executor": "slurm", "job_id": "7",
                        "job_name": "relax-st", "submitted_at": time.time()})
    write_json(rd.state, {"state": "RUNNING", "step": 1, "total_steps": 4,
                          "roles": {"actor": {"phase": "train"}, "rollout": {"phase": "generate"}}})
    return rd


def squeue_rows(*labels: str) -> list[slurm.Component]:
    """What squeue --format prints for job 7 (its components' ids, labels, states, ...), parsed and selected as
    relax-status's query does."""
    now = int(time.time())
    lines = [f"{7 + i}|{label}|RUNNING|None|node[1-3]|3|debug|{now}|{now}|N/A|10:00|relax-st"
             for i, label in enumerate(labels)]
    return slurm._select(slurm._squeue_text("\n".join(lines)), 7, "relax-st")


def shown(info: dict) -> str:
    out = io.StringIO()
    Console(file=out, width=160).print(status.render(info))
    return out.getvalue()


def test_one_allocation_is_one_component_named_by_its_job_id(tmp_path, monkeypatch):
    rd = run_dir(tmp_path, "single")
    monkeypatch.setattr(status.slurm, "job_components", lambda job_id, name=None, submitted_at=None: squeue_rows("7"))
    info = status.collect(rd)
    assert [c["label"] for c in info["components"]] == ["7"]
    assert info["components"][0]["roles"] == ["actor", "reference", "rollout"]  # every role, one allocation
    assert info["state"] == "RUNNING" and 590 <= info["time_left_s"] <= 600
    assert "7+0" not in shown(info)


def test_slurm_forgot_a_single_layout_job_still_one_component(tmp_path, monkeypatch):
    rd = run_dir(tmp_path, "single")
    monkeypatch.setattr(status.slurm, "job_components", lambda job_id, name=None, submitted_at=None: [])
    info = status.collect(rd)
    assert [(c["label"], c["roles"]) for c in info["components"]] == [("7", ["actor", "reference", "rollout"])]
    assert "+0" not in shown(info) and "+1" not in shown(info)


def test_a_het_job_keeps_its_component_labels(tmp_path, monkeypatch):
    rd = run_dir(tmp_path, "hetjob")
    monkeypatch.setattr(status.slurm, "job_components",
                        lambda job_id, name=None, submitted_at=None: squeue_rows("7+0", "7+1"))
    info = status.collect(rd)
    assert [(c["label"], c["roles"]) for c in info["components"]] == [("7+0", ["actor", "reference"]),
                                                                       ("7+1", ["rollout"])]
