"""The genrm role: the run's LLM judge, a set of engines serving the frozen ``genrm.model_path``.

Each rank starts one engine (:mod:`relax_hpc.roles.engine_host`, the same machinery as rollout's, with the run's
API key), so the role's size (``roles.genrm``: nodes × tasks_per_node) is the number of judges. Every replica is
seeded with ``run.seed`` (Relax's judges all are), and the client seeds each request by its text, so a verdict does
not depend on which judge gave it. Judges never get weight syncs. Tasks:

- ``start_engines``: ``{"engines": {judge0: url, ...}, "pids", "nodes"}``; the controller then gives the URLs to
  rollout with every ``generate`` and ``eval``, where :mod:`relax_hpc.rollout.genrm` serves reward functions;
- ``stop``: the engines stop (by PID) on the way out, whatever happened.
"""

from __future__ import annotations

import sys
from typing import Any

from relax_hpc.roles.engine_host import gather_engines, start_engines_result, start_rank_engine
from relax_hpc.roles.runtime import RoleContext, main

ROLE = "genrm"


def _start_judge(ctx: RoleContext) -> Any:
    r = ctx.recipe
    if r.genrm.model_path is None:
        raise ValueError("roles.genrm is enabled but genrm.model_path is not set: the judge has no model")
    return start_rank_engine(ctx, r.roles.genrm, r.genrm.model_path, seed=r.run.seed, prefix="judge")


def work(ctx: RoleContext, comm: Any) -> None:
    from relax_hpc.controller import messages as M
    from relax_hpc.roles.tasks import serve

    engine = ctx.prepared
    try:
        everyone = gather_engines(ctx, engine, "judge")

        def start_engines(task: M.StartEnginesTask) -> M.StartEnginesResult:
            return start_engines_result(everyone)

        serve(ctx, comm, {"start_engines": start_engines, "stop": lambda task: M.StopResult()})
    finally:
        engine.stop()


if __name__ == "__main__":
    sys.exit(main(ROLE, work, prepare=_start_judge))
