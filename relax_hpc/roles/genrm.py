"""The genrm role: the run's LLM judge, a set of engines serving the frozen ``genrm.model_path``.

Each rank starts one engine (:func:`relax_hpc.roles.engine_host.start_frozen_engine`, the same machinery as
rollout's, with the run's API key), so the role's size (``roles.genrm``: nodes × tasks_per_node) is the number of
judges. Every replica is seeded with ``run.seed`` (Relax's judges all are), and the client seeds each request by
its text, so a verdict does not depend on which judge gave it. Judges never get weight syncs. Tasks
(:func:`~relax_hpc.roles.engine_host.serve_frozen_engines`):

- ``start_engines``: ``{"engines": {judge0: url, ...}, "pids", "nodes"}``; the controller then gives the URLs to
  rollout with every ``generate`` and ``eval``, where :mod:`relax_hpc.rollout.genrm` serves reward functions;
- ``stop``: the engines stop (by PID) on the way out, whatever happened.
"""

from __future__ import annotations

import sys
from typing import Any

from relax_hpc.roles.engine_host import serve_frozen_engines, start_frozen_engine
from relax_hpc.roles.runtime import RoleContext, main

ROLE = "genrm"


def _start_judge(ctx: RoleContext) -> Any:
    return start_frozen_engine(ctx, ROLE, ctx.recipe.genrm.model_path, "genrm.model_path", "judge")


def work(ctx: RoleContext, comm: Any) -> None:
    serve_frozen_engines(ctx, comm, "judge")


if __name__ == "__main__":
    sys.exit(main(ROLE, work, prepare=_start_judge))
