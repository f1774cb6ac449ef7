"""A draining engine gets no new request from the driver (RUN_DIR/draining, read through NamesFile); the requests
go to the others, and only when every engine is leaving do they still go to a leaving one."""

from __future__ import annotations

import asyncio
import json
import os

from relax_hpc.rollout.driver import NamesFile, _Engine, _EnginePool


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
    pool = _EnginePool([_Engine(name=n, client=None) for n in ("e0", "e1")], per_engine=4,
                       leaving=lambda: frozenset(leaving))

    async def picks(k):
        return [(await pool.acquire()).name for _ in range(k)]

    assert asyncio.run(picks(4)) == ["e1"] * 4
    leaving.add("e1")  # all leaving: better late than hung
    assert set(asyncio.run(picks(2))) <= {"e0", "e1"}
