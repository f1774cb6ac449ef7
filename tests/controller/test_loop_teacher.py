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


def fail_first_generate(loop, ch, report: M.TaskError) -> dict:
    """Drive the loop until its first generate, which ``report`` answers; the generate task."""
    deliver_joins(loop, ch)
    while ch.queue:
        role, task = ch.queue.pop(0)
        res = report if task["kind"] == "generate" else answer(loop, task, role)
        loop.on_message({"type": "task_done", "task_id": task["id"], "rank": 0, "result": res.to_dict()})
        deliver_joins(loop, ch)
        if task["kind"] == "generate":
            return task
    raise AssertionError("no generate went out")


def generates(ch) -> list[dict]:
    return [t for role, t in ch.queue if t["kind"] == "generate"]


def test_the_run_s_own_teacher_dying_mid_generate_is_restarted_alone_and_the_generate_goes_again(tmp_path):
    """The teacher role's engine died: the rollout's generate gets no answer (TeacherError, the rollout role serves
    on). The run does not fail: the controller waits for the teacher's verdict, here its death found after the error
    (under Slurm the step's end comes late): the teacher is started again alone, and once its new engine is known
    the same step's generate goes again, with the same data cursor, to the new teacher. A teacher that refuses the
    request or answers unusable numbers still ends the run."""
    from relax_hpc.rollout.teacher import TeacherBadValues, TeacherError, TeacherRefused

    err = dead_teacher_error()
    assert type(err) is TeacherError and "127.0.0.1" in str(err)
    recipe = opd_recipe(tmp_path, own=True, steps=2)
    run = sim_run(tmp_path, recipe)
    report = reported(run, err)
    assert report.restartable and report.error.startswith("TeacherError: ")
    loop, ch = sim_loop(recipe, run)
    first = fail_first_generate(loop, ch, report)
    assert loop.state.running and loop.state.failure is None, loop.state.doc["reason"]
    loop.tick()
    assert generates(ch) == []  # no verdict yet: nothing generated meanwhile
    ch.drop = lambda role: []  # the channel's queue of the role restarted alone (FakeChannel has none; it is idle)
    loop.role_restarted("teacher")  # the loop's _restart_alone, once the teacher's death is found
    (start,) = [t for role, t in ch.queue if role == "teacher"]
    assert start["kind"] == "start_engines" and generates(ch) == []  # the new teacher's engine first
    ch.queue.remove(("teacher", start))
    new = {"teacher0": "http://10.0.0.9:7200"}
    loop.on_message({"type": "task_done", "task_id": start["id"], "rank": 0,
                     "result": M.StartEnginesResult(engines=new, pids={"teacher0": 43}).to_dict()})
    (again,) = generates(ch)
    assert (again["step"], again["data_state"], again["seq"]) == (first["step"], first["data_state"], first["seq"])
    assert again["teachers"] == new and first["teachers"] == TEACHER
    assert [e["event"] for e in loop.state.doc["events"]].count("generate_again") == 1
    done = drive(loop, ch)  # the run goes on
    assert [s for k, s in done if k == "train"] == ["1", "2"] and loop.state.running
    loop.finish()
    for permanent in (TeacherRefused("HTTP 400"), TeacherBadValues("NaN log-probs")):
        assert not reported(run, permanent).restartable


def test_a_teacher_alive_gets_the_generate_again_then_is_restarted_alone(tmp_path):
    """TeacherError while every teacher rank goes on speaking (its role alive, its engine not answering): the step's
    generate goes again, TEACHER_RETRIES times, then the teacher is failed alone (role tier: the loop starts it
    again)."""
    from relax_hpc.controller.training import TEACHER_RETRIES

    recipe = opd_recipe(tmp_path, own=True, steps=1)
    run = sim_run(tmp_path, recipe)
    report = M.TaskError(error="TeacherError: the OPD teacher gave no answer", restartable=True)
    loop, ch = sim_loop(recipe, run)
    first = fail_first_generate(loop, ch, report)
    loop.state.ranks["teacher"][0].info["cross_group"] = {"ok": True}  # its start's check passed (a heartbeat says)
    for k in range(TEACHER_RETRIES + 1):
        since = loop.teacher_wait[1]  # when the failure came in
        loop.state.ranks["teacher"][0].last = since - 1  # its last word before it
        loop.tick()
        assert generates(ch) == []  # the teacher has not spoken since: no verdict
        loop.state.ranks["teacher"][0].last = since + 1e-3  # a heartbeat after the failure: alive
        loop.tick()
        if k == TEACHER_RETRIES:
            break
        (again,) = generates(ch)
        assert (again["step"], again["data_state"]) == (first["step"], first["data_state"])
        ch.queue.remove(("rollout", again))
        loop.on_message({"type": "task_done", "task_id": again["id"], "rank": 0, "result": report.to_dict()})
    assert generates(ch) == [] and list(loop.state.alone) == ["teacher"] and loop.state.running
    assert "gave rollout no answer in step 1's generate 3 times while the role lived" in \
        loop.state.alone["teacher"].message
    loop.finish()


def test_an_outside_teacher_that_gives_no_answer_uses_a_restart(tmp_path):
    """opd.teacher_url: nothing of the run's to restart alone, so a TeacherError fails the try as a step's failure,
    which a restart may fix: state.json says restarting, not FAILED."""
    recipe = opd_recipe(tmp_path, own=False, steps=2)
    run = sim_run(tmp_path, recipe)
    loop, ch = sim_loop(recipe, run)
    fail_first_generate(loop, ch, M.TaskError(error="TeacherError: no answer", restartable=True))
    st = loop.state
    assert st.doc["state"] == "FAILED" and st.failure.kind == "role" and st.will_restart
    assert "TeacherError" in st.doc["reason"] and st.failure.role == "rollout"
    st.write()
    ctl, problem = read_state(run)  # as relax-status and a watcher read state.json: the run goes on
    assert problem is None and (ctl["state"], ctl["phase"]) == ("RUNNING", "restarting")
    loop.finish()
