"""The teacher role: on-policy distillation's teacher (``opd:``), a set of engines serving the frozen
``opd.teacher_model_path`` (Relax's ``--teacher-hf-checkpoint``).

Each rank starts one engine, as genrm's judges (:func:`relax_hpc.roles.engine_host.start_frozen_engine`: rollout's
machinery, the run's API key, seeded with ``run.seed``), so the role's size (``roles.teacher``: nodes ×
tasks_per_node) is the number of teachers. Teachers never get weight syncs. Tasks
(:func:`~relax_hpc.roles.engine_host.serve_frozen_engines`):

- ``start_engines``: ``{"engines": {teacher0: url, ...}, "pids", "nodes"}``; the controller then gives the URLs to
  rollout with every ``generate``, where :mod:`relax_hpc.rollout.teacher` asks them for the log-probs of the
  student's response tokens;
- ``stop``: the engines stop (by PID) on the way out, whatever happened.

The teacher must use the student's tokenizer: it scores the student's token ids as they are. A teacher that dies is
started again alone (the role tier, ``health.max_role_restarts``): its new engines' URLs go with the next generate.
One that dies while rollout asks it fails that generate (:class:`~relax_hpc.rollout.teacher.TeacherError`; the rollout
role serves on); the controller waits for this role's verdict: dead, it is started again alone; alive (its engine
gone, or slow), the generate goes again, and after :data:`~relax_hpc.controller.training.TEACHER_RETRIES` such tries
the role is started again alone. Either way the step's generate goes again from the same data cursor; the actor, the
rollout driver and the rollout engines keep their processes.
"""

from __future__ import annotations

import sys
from typing import Any

from relax_hpc.roles.engine_host import serve_frozen_engines, start_frozen_engine
from relax_hpc.roles.runtime import RoleContext, main

ROLE = "teacher"


def _start_teacher(ctx: RoleContext) -> Any:
    opd = ctx.recipe.opd
    return start_frozen_engine(ctx, ROLE, opd.teacher_model_path if opd else None, "opd.teacher_model_path", ROLE)


def work(ctx: RoleContext, comm: Any) -> None:
    serve_frozen_engines(ctx, comm, ROLE)


if __name__ == "__main__":
    sys.exit(main(ROLE, work, prepare=_start_teacher))
