"""On-policy distillation's teacher in the training loop, driven by hand (:mod:`loop_sim`): the teacher role's engines
are started at boot like the GenRM judges, no step is generated before they are known, and every ``generate`` carries
their URLs (or ``opd.teacher_url``); ``state.json`` lists them, and the train task reads ``teacher_log_probs``."""

from __future__ import annotations

import dataclasses

from loop_sim import drive, metrics, sim_loop, sim_recipe, sim_run

from relax_hpc.algo.config import OPDConfig
from relax_hpc.launch.status import read_state
from relax_hpc.recipe.schema import RoleGroup

TEACHER = {"teacher0": "http://10.0.0.9:7100"}  # what loop_sim's teacher role reports


def opd_recipe(tmp_path, own: bool, steps: int = 2):
    r = sim_recipe(tmp_path, f"run.steps={steps}")
    opd = OPDConfig(teacher_model_path="/no/teacher") if own else OPDConfig(teacher_url="http://t:30000/generate")
    return dataclasses.replace(r, opd=opd, roles=dataclasses.replace(r.roles, teacher=RoleGroup(enabled=own)))


def record(ch) -> list[tuple]:
    """Every task handed out from now on ("+", role, kind, task) and answered ("-", kind, task id), in order."""
    log = [("+", role, t["kind"], t) for role, t in ch.queue]
    assign = ch.assign

    def assigned(role, task):
        log.append(("+", role, task["kind"], task))
        assign(role, task)

    ch.assign = assigned
    return log


def test_the_teacher_engines_start_first_and_go_with_every_generate(tmp_path):
    recipe = opd_recipe(tmp_path, own=True)
    run = sim_run(tmp_path, recipe)
    loop, ch = sim_loop(recipe, run)
    log = record(ch)
    assert ("+", "teacher", "start_engines") in [e[:3] for e in log]
    done = drive(loop, ch, special=lambda task: log.append(("-", task["kind"], task["id"])))
    assert [s for k, s in done if k == "train"] == ["1", "2"]
    gens = [e[3] for e in log if e[0] == "+" and e[2] == "generate"]
    assert len(gens) == 2 and all(g["teachers"] == TEACHER and g["judges"] == {} for g in gens)
    # no step is generated before the teachers are known
    teacher_start = next(e[3]["id"] for e in log if e[:3] == ("+", "teacher", "start_engines"))
    assert log.index(("-", "start_engines", teacher_start)) < log.index(next(e for e in log if e[2] == "generate"))
    assert ("+", "teacher", "stop") in [e[:3] for e in log]  # stopped with the other roles at the end
    assert "teacher_log_probs" in loop.broker.tasks["train"]  # a chunk without them is never trained on
    loop.finish()
    want = {"teacher0": {"url": TEACHER["teacher0"], "pid": 42, "node": "n9"}}
    assert loop.state.doc["teachers"] == want
    loop.state.write()
    ctl, problem = read_state(run)  # as relax-status reads state.json
    assert problem is None and ctl["teachers"] == want
    assert [r["step"] for r in metrics(run)] == [1, 2]


def test_an_external_teacher_url_goes_with_every_generate_and_no_teacher_role_runs(tmp_path):
    recipe = opd_recipe(tmp_path, own=False)
    run = sim_run(tmp_path, recipe)
    loop, ch = sim_loop(recipe, run)
    log = record(ch)
    drive(loop, ch)
    assert not [e for e in log if e[1] == "teacher"]
    gens = [e[3] for e in log if e[2] == "generate"]
    # the client calls /generate on the URL it is given: the endpoint's base
    assert gens and all(g["teachers"] == {"opd.teacher_url": "http://t:30000"} for g in gens)
    loop.finish()
    assert loop.state.doc["teachers"] == {"opd.teacher_url": {"url": "http://t:30000", "pid": None, "node": None}}


def test_without_opd_no_teacher_goes_out_and_train_reads_no_teacher_field(tmp_path):
    recipe = sim_recipe(tmp_path, "run.steps=1")
    run = sim_run(tmp_path, recipe)
    loop, ch = sim_loop(recipe, run)
    log = record(ch)
    drive(loop, ch)
    assert [e[3]["teachers"] for e in log if e[2] == "generate"] == [{}]
    assert "teacher_log_probs" not in loop.broker.tasks["train"] and "teachers" not in loop.state.doc
    loop.finish()
