"""The engine pool: a draining engine gets no new request from the driver (RUN_DIR/draining, read through NamesFile); the requests
go to the others, and only when every engine is leaving do they still go to a leaving one."""

from __future__ import annotations

import asyncio
import json
import os

from relax_hpc.engines.pool import Engine, EnginePool, NamesFile


def test_names_file_follows_the_controllers_rewrites(tmp_path):
    path = tmp_path / "draining"
    names = NamesFile(path, every_s=0.0)
    assert names() == frozenset()  # absent: nothing drains
    path.write_text(json.dumps(["a"]))
    assert names() == {"a"}
    path.write_text(json.dumps([]))
    os.utime(path, (1, 1))  # a new mtime however fast the rewrite
    assert names() == frozenset()


def test_the_pool_skips_leaving_engines():
    leaving = {"e0"}
    pool = EnginePool([Engine(name=n, client=None) for n in ("e0", "e1")], per_engine=4,
                       leaving=lambda: frozenset(leaving), none_left=RuntimeError)

    async def picks(k):
        return [(await pool.acquire()).name for _ in range(k)]

    assert asyncio.run(picks(4)) == ["e1"] * 4
    leaving.add("e1")  # all leaving: better late than hung
    assert set(asyncio.run(picks(2))) <= {"e0", "e1"}


def test_the_pool_integrates_its_request_queue(monkeypatch):
    """Requests that find every engine at its bound wait in the pool; queue_clock integrates how many waited over
    time (the autoscaler's "requests queued per engine"). A clock stepped by hand makes the integral exact."""
    from relax_hpc.engines import pool as pool_mod

    now = [100.0]
    monkeypatch.setattr(pool_mod.time, "monotonic", lambda: now[0])
    pool = EnginePool([Engine(name="e0", client=None)], per_engine=1, none_left=RuntimeError)

    async def scenario():
        first = await pool.acquire()
        a0 = pool.queue_clock()
        waiters = [asyncio.create_task(pool.acquire()) for _ in range(2)]
        while pool.waiting < 2:  # both queued: the engine is at its bound
            await asyncio.sleep(0)
        now[0] += 10.0
        await pool.release(first)  # one waiter gets the engine, one still waits
        while pool.waiting > 1:
            await asyncio.sleep(0)
        now[0] += 5.0
        second = next(t for t in waiters if t.done()).result()
        await pool.release(second)
        await asyncio.gather(*waiters)
        assert pool.waiting == 0
        now[0] += 7.0  # nobody waits: the integral does not grow
        return a0, pool.queue_clock()

    (area0, t0), (area1, t1) = asyncio.run(scenario())
    assert (area1 - area0, t1 - t0) == (2 * 10.0 + 1 * 5.0, 22.0)


def test_the_pool_raises_the_error_it_is_given_when_no_engine_is_left():
    """The pool is the engines' side; what "no engine left" means to its user (the rollout driver's NoEngineError,
    which a restart can cure) is the user's to say."""
    import pytest

    from relax_hpc.rollout.errors import NoEngineError

    pool = EnginePool([Engine(name="e0", client=None, dead="refused a connection")], per_engine=1,
                      none_left=NoEngineError)
    with pytest.raises(NoEngineError, match="e0: refused a connection"):
        asyncio.run(pool.acquire())
