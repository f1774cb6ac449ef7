"""On-policy distillation's teacher in the training loop, driven by hand (:mod:`loop_sim`): the teacher role's engines
are started at boot like the GenRM judges, no step is generated before they are known, and every ``generate`` carries
their URLs (or ``opd.teacher_url``); ``state.json`` lists them, and the train task reads ``teacher_log_probs``."""

from __future__ import annotations

import dataclasses

from loop_sim import answer, deliver_joins, drive, metrics, sim_loop, sim_recipe, sim_run

from relax_hpc.algo.config import OPDConfig
from relax_hpc.controller import messages as M
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


def dead_teacher_error(timeout_s: float = 2.0) -> BaseException:
    """What rollout's teacher client raises when the run's own teacher engine is gone: a real client, a port no one
    listens on any more."""
    import socket

    from relax_hpc.rollout.sample import Sample
    from relax_hpc.rollout.teacher import TeacherClient, TeacherClientConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed on leaving: nothing listens there
    client = TeacherClient(TeacherClientConfig(urls=[f"http://127.0.0.1:{port}"], timeout_s=timeout_s, retries=2))
    try:
        client.score([Sample(index=0, tokens=[1, 2, 3], response_length=1)])
    except BaseException as e:  # noqa: BLE001 (the error is what the test looks at)
        return e
    finally:
        client.close()
    raise AssertionError("a teacher that is gone answered")


def reported(run, error: BaseException) -> M.TaskError:
    """``error`` as the rollout role's rank 0 reports a task that raised it (roles.tasks.TaskStream.failed)."""
    from types import SimpleNamespace

    from relax_hpc.roles.tasks import TaskStream

    sent = []
    stream = TaskStream.__new__(TaskStream)  # rank 0's stream, its control connection a recorder
    stream.ctx = SimpleNamespace(run=run, ident=SimpleNamespace(role="rollout", rank=0))
    stream._client = SimpleNamespace(task_done=lambda role, rank, task_id, result: sent.append(result))
    stream.failed({"id": 1, "kind": "generate"}, error)
    return M.decode_result("generate", sent[0])


def test_the_run_s_own_teacher_engine_dying_uses_a_restart(tmp_path):
    """The teacher role's engine died: the rollout's generate gets no answer from it (TeacherError, transient), reports
    it restartable, and the controller fails the try as a step's failure, which a restart fixes (it starts the teacher
    role, and so its engines, again): state.json says restarting, not FAILED. A teacher that refuses the request or
    answers unusable numbers would do the same after a restart: those still end the run at once."""
    from relax_hpc.rollout.teacher import TeacherBadValues, TeacherError, TeacherRefused

    err = dead_teacher_error()
    assert type(err) is TeacherError and "127.0.0.1" in str(err)
    recipe = opd_recipe(tmp_path, own=True, steps=2)
    run = sim_run(tmp_path, recipe)
    report = reported(run, err)
    assert report.restartable and report.error.startswith("TeacherError: ")
    loop, ch = sim_loop(recipe, run)
    deliver_joins(loop, ch)
    while ch.queue:
        role, task = ch.queue.pop(0)
        res = report if task["kind"] == "generate" else answer(loop, task, role)
        loop.on_message({"type": "task_done", "task_id": task["id"], "rank": 0, "result": res.to_dict()})
        deliver_joins(loop, ch)
        if task["kind"] == "generate":
            break
    st = loop.state
    assert st.doc["state"] == "FAILED" and st.failure.kind == "role" and st.will_restart
    assert "TeacherError" in st.doc["reason"] and st.failure.role == "rollout"
    st.write()
    ctl, problem = read_state(run)  # as relax-status and a watcher read state.json: the run goes on
    assert problem is None and (ctl["state"], ctl["phase"]) == ("RUNNING", "restarting")
    loop.finish()
    for permanent in (TeacherRefused("HTTP 400"), TeacherBadValues("NaN log-probs")):
        assert not reported(run, permanent).restartable
