"""Resume planning and the fixed-staleness rules the plan feeds, on a real exchange (the broker's journal and
directory) and a real ``checkpoints/latest``: a fresh start, a plain resume, kept steps that are (or are no longer)
in the exchange, and the rewind of an earlier attempt's later partitions."""

from __future__ import annotations

from loop_sim import fake_checkpoint, sim_recipe, sim_run
from relax_hpc.backends import LocalBackend
from relax_hpc.controller.fixed_staleness import FixedStaleness
from relax_hpc.controller.generation import Generation
from relax_hpc.controller.resume_plan import plan_resume
from relax_hpc.controller.state import RunState
from relax_hpc.exchange.broker import Broker
from relax_hpc.exchange.chunk import ChunkRef
from relax_hpc.exchange.fields import PRODUCER, task_fields
from relax_hpc.recipe import role_steps

FIXED = ("run.steps=6", "mode=fully_async", "max_staleness=1", "staleness_mode=fixed")


def setup(tmp_path, *overrides: str):
    recipe = sim_recipe(tmp_path, *overrides)
    run = sim_run(tmp_path, recipe)
    state = RunState(run, recipe, role_steps(recipe), LocalBackend())
    broker = Broker(run.path / "exchange", tasks={"train": task_fields("train", (PRODUCER,))}, max_staleness=5)
    broker.check_files = False  # the chunks are only announced, never written
    return run, state, broker


def generate(broker: Broker, n: int) -> None:
    """Step ``n`` generated as rollout's report would have it: started, one chunk announced, ended."""
    assert broker.start_step(n)
    broker.announce(ChunkRef.from_dict({"path": str(broker.root / f"step_{n}" / f"chunk_{PRODUCER}_{n}.h5"),
                                        "step": n, "n": 4, "fields": list(task_fields("train", (PRODUCER,))),
                                        "checksum": "0", "size": 1, "attrs": {}, "sides": []}))
    broker.end_step(n)


def kept(g: int, k: int = 2) -> dict:
    return {"step": k, "data": {"offset": k}, "kept": {"generated": g, "data": {"offset": g},
                                                        "metrics": {str(n): {"rollout/raw_reward": n} for n in
                                                                    range(k + 1, g + 1)}}}


def test_a_fresh_start_plans_nothing(tmp_path):
    run, state, broker = setup(tmp_path)
    plan = plan_resume(run.path, broker, state, fixed=False, max_staleness=0, total=4)
    assert (plan.path, plan.step, plan.generated, plan.data, plan.kept, plan.unfixed_upto) == (None, 0, 0, None, None, 0)
    assert plan.kept_rows() == {}


def test_a_resume_starts_at_the_checkpoint_and_rewinds_the_later_partitions(tmp_path):
    run, state, broker = setup(tmp_path)
    for n in (1, 2, 3):  # an earlier attempt generated step 3 after its checkpoint of step 2
        generate(broker, n)
    fake_checkpoint(run, 2)
    plan = plan_resume(run.path, broker, state, fixed=False, max_staleness=0, total=4)
    assert plan.path == str(run.path / "checkpoints" / "step_00000002")
    assert (plan.step, plan.generated, plan.data, plan.kept) == (2, 2, {"offset": 2}, None)
    plan.rewind(broker)
    assert broker.progress("train", 2)["ended"] and broker.chunks(3) == []  # step 3 voided: produced again
    gen = Generation(plan.step, plan.generated, plan.data)
    assert gen.next() == 3 and gen.cursor(3) == {"offset": 2}


def test_fixed_keeps_the_steps_generated_before_the_checkpoint_while_the_exchange_has_them_whole(tmp_path):
    run, state, broker = setup(tmp_path, *FIXED)
    for n in (1, 2, 3):
        generate(broker, n)
    fake_checkpoint(run, 2, kept(3))
    plan = plan_resume(run.path, broker, state, fixed=True, max_staleness=1, total=6)
    assert (plan.step, plan.generated, plan.unfixed_upto) == (2, 3, 0)
    assert plan.kept_rows() == {3: {"rollout/raw_reward": 3.0}}
    assert "fixed_staleness_broken" not in [e["event"] for e in state.doc["events"]]
    plan.rewind(broker)
    assert broker.progress("train", 3)["ended"]  # kept, not voided
    gen = Generation(plan.step, plan.generated, plan.data, plan.kept["data"])
    assert gen.next() == 4 and gen.cursor(4) == {"offset": 3} and gen.cursor(3) == {"offset": 2}


def test_fixed_generates_the_kept_steps_again_on_the_checkpoints_weights_when_the_exchange_lost_them(tmp_path):
    run, state, broker = setup(tmp_path, *FIXED)
    for n in (1, 2):  # step 3 never reached this exchange (or was trained after the checkpoint, and cleared)
        generate(broker, n)
    fake_checkpoint(run, 2, kept(3))
    plan = plan_resume(run.path, broker, state, fixed=True, max_staleness=1, total=6)
    assert (plan.step, plan.generated, plan.kept) == (2, 2, None)
    assert plan.unfixed_upto == 3  # step 3 needs step 1's weights, which the resume does not have: step 2's
    assert "fixed_staleness_broken" in [e["event"] for e in state.doc["events"]]
    # a plain (bounded) resume never keeps anything
    assert plan_resume(run.path, broker, state, fixed=False, max_staleness=1, total=6).kept is None


def test_fixed_rules_hold_a_sync_until_the_last_step_on_older_weights_and_a_checkpoint_keeps_those():
    f = FixedStaleness(k=1, total=5)
    assert [f.last_on_old(n) for n in (1, 4, 5)] == [2, 5, 5]
    assert f.waits(1, generated=1) and not f.waits(1, generated=2)
    assert f.owed(2, held=1) and not f.owed(3, held=1) and not f.owed(2, held=None)
    assert f.exact(3, voided=set()) and not f.exact(3, voided={3})
    f.loose.add(2)  # let go: no engine held its weights any more
    assert not f.waits(1, generated=1) and not f.exact(2, voided=set())
    f.rows[3] = {"rollout/raw_reward": 0.3}
    assert f.kept(2, {2: {"offset": 2}, 3: {"offset": 3}}) == {"generated": 3, "data": {"offset": 3},
                                                              "metrics": {"3": {"rollout/raw_reward": 0.3}}}
    assert f.kept(3, {}) is None  # step 4 not generated yet: nothing to keep
