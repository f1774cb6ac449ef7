"""The rollout role: the driver. It reads the data, sends generate requests to the engines, and rewards the samples.

It is one task. The inference engines are not its ranks: each is a job step of its own that the controller
starts and owns (:mod:`relax_hpc.roles.engine`; ``roles.rollout``'s nodes × tasks_per_node engine slots, the
CPU engine where there is no CUDA, SGLang from ``RELAX_SGLANG_PYTHON`` on GPU nodes). Every task names the
engines it may use, from the controller's registry, so engines join, leave, die and come back while the driver
goes on. Tasks (:mod:`relax_hpc.roles.tasks`; their fields and results: :mod:`relax_hpc.controller.messages`):

- ``start_engines``: returns the data cursor at the start (``data_state``: a fresh run's step 1 starts from it),
  and no engines (the controller started those).
- ``generate {step, engines, seq, data_state}``: from the data cursor after step−1 (so a step generated again, e.g.
  after a damaged chunk, gets the same prompts; with partial rollout the cursor names the buffer that goes with
  it, loaded with it: :meth:`~relax_hpc.rollout.generator.Generator.restore`), the next ``rollout_batch_size``
  prompt groups from ``data.path`` (with ``rollout.dynamic_sampling_filter_path``: drawn in rounds until that many
  pass the filter, :mod:`relax_hpc.rollout.dynamic`), generated with :class:`~relax_hpc.rollout.driver.RolloutDriver`
  on the live engines (a dead one is reported by name and its requests go to the others), scored by the reward
  (``rollout.custom_rm_path`` / ``rm_type``), written as one chunk in ``RUN_DIR/exchange/step_<N>/`` (with
  ``rollout.stream_groups: G``, as chunks of G groups each, written and reported with ``chunk_ready`` as soon as
  their groups are done: :class:`~relax_hpc.rollout.generator.Streamer`), whose attrs name its prompt groups (the
  audit counts prompts per epoch with them, :mod:`relax_hpc.exchange.audit`).
  Returns the chunk ref, Relax's ``rollout/*`` metrics, the data cursor (with partial rollout, and the saved
  buffer's reference), the weight versions the samples carry, reward failures (with their samples) and engine
  failures. With ``judges`` (the genrm role's engines), reward functions reach them through
  :mod:`relax_hpc.rollout.genrm`, and the step's ``genrm/*`` counts join the metrics. With ``opd:`` (on-policy
  distillation), once the samples are rewarded, the teacher (``teachers``: the teacher role's engines, or
  ``opd.teacher_url``) scores each sample's response tokens (:mod:`relax_hpc.rollout.teacher`): the chunk carries
  them as ``teacher_log_probs`` and the step's ``opd/*`` counts join the metrics. A teacher that fails for good,
  or gives a sample no good numbers, fails the step with its error: no step is written without them.
- ``eval {step}``: every ``data.eval_prompt_data`` set (loaded once, at start; relative paths as ``data.path``'s),
  ``rollout.n_samples_per_eval_prompt`` samples per prompt, generated with the engines' current weights and the
  eval sampling parameters, scored with ``eval_reward_key`` (:func:`~relax_hpc.rollout.eval.run_eval`). Requests
  are seeded by (run seed, step), apart from the training ones (which are seeded per sample anyway), and the data
  cursor is not touched: eval never changes what training samples. Nothing goes to the exchange. Returns
  ``eval/<name>``, ``eval/<name>-pass@k``, ``eval/<name>-truncated_ratio``, ``eval/<name>/response_len/*``,
  ``eval/step`` and ``perf/eval_time``.
- ``stop``: the driver ends (the engines are the controller's to stop).

Engines are started with the run's API key (:meth:`relax_hpc.rundir.RunDir.api_key`) and the driver's clients
send it; anything else that calls the engines (the actor's weight sync) must send it too.

This module is the entry point only: it turns each task into a call of
:class:`~relax_hpc.rollout.generator.Generator` (the step's logic: regeneration, partial rollout's buffer, OPD, MoE
rows, streaming) and its result into the reply; ``data_state`` goes over the wire as
:meth:`~relax_hpc.rollout.state.DataState.to_dict` and comes back through ``from_dict``. The generator's outlets, the
chunk writer (``train/``) and the ``chunk_ready`` announcement (the control socket), are given here: ``rollout/``
imports neither ``train`` nor ``controller``.

Without ``model.path`` the role only bootstraps (the launch smoke tests).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from relax_hpc.roles.runtime import RoleContext, main, resolve

if TYPE_CHECKING:
    from relax_hpc.controller import messages as M
    from relax_hpc.rollout.generator import Generator
    from relax_hpc.rundir import RunDir

ROLE = "rollout"
log = logging.getLogger("relax_hpc.rollout")


def _sniffio_shim() -> None:
    """httpcore imports ``sniffio`` on every async request to tell asyncio from trio; where sniffio is not
    installed (httpx 0.28 no longer requires it) that failed import searches sys.path each time: ~1 ms per
    generate request. The rollout role runs asyncio only, so answer the question once."""
    try:
        import sniffio  # noqa: F401
    except ImportError:
        import types

        shim = types.ModuleType("sniffio")
        shim.current_async_library = lambda: "asyncio"  # type: ignore[attr-defined]
        sys.modules["sniffio"] = shim


class ChunkAnnouncer:
    """``chunk_ready`` for a streamed chunk, on a connection of its own to the controller (opened at the first)."""

    def __init__(self, run: RunDir):
        self.run, self.client = run, None

    def __call__(self, task_id: int, ref: Any) -> None:
        from relax_hpc.controller.protocol import Client

        if self.client is None:
            addr = self.run.read_json(self.run.controller_addr)
            self.client = Client(addr["host"], int(addr["port"]), self.run.token(), timeout_s=30.0)
        self.client.request("chunk_ready", role="rollout", rank=0, task_id=int(task_id), chunk=ref.to_dict())

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def make_generator(ctx: RoleContext, announce: Any = None) -> Generator:
    """The rollout role's :class:`~relax_hpc.rollout.generator.Generator`, its outlets given: the chunk writer, the
    announcement of streamed chunks (default: a :class:`ChunkAnnouncer`), the complete checkpoints."""
    from relax_hpc.rollout.generator import Generator, Outlets
    from relax_hpc.rollout.write import write_step
    from relax_hpc.train.latest import complete

    outlets = Outlets(write_step=write_step, announce=announce or ChunkAnnouncer(ctx.run), complete=complete)
    return Generator(ctx.recipe, ctx.run, outlets, resolve=resolve, progress=ctx.progress)


def generate(gen: Generator, task: M.GenerateTask) -> M.GenerateResult:
    """A generate task through the generator: the wire's data_state in and out."""
    from relax_hpc.controller.messages import GenerateResult
    from relax_hpc.rollout.state import DataState

    out = gen.generate(task.step, seq=task.seq, engines=task.engines,
                       start=DataState.from_dict(task.data_state) if task.data_state else None,
                       judges=task.judges, teachers=task.teachers, streamed=task.streamed, task_id=int(task.id))
    return GenerateResult(chunks=out.chunks, metrics=out.metrics, n=out.n, weight_versions=out.weight_versions,
                          data_state=out.state.to_dict(), reward_failures=out.reward_failures,
                          engine_failures=out.engine_failures, dead_engines=out.dead_engines,
                          engine_requests=out.engine_requests)


def work(ctx: RoleContext, comm: Any) -> None:
    if ctx.recipe.model.path is None:
        return
    _sniffio_shim()
    from relax_hpc.controller import messages as M
    from relax_hpc.roles.tasks import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s [rollout] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    announce = ChunkAnnouncer(ctx.run)
    gen = make_generator(ctx, announce)

    def start_engines(task: M.StartEnginesTask) -> M.StartEnginesResult:
        return M.StartEnginesResult(engines={}, data_state=gen.state(0).to_dict())

    def evaluate(task: M.EvalTask) -> M.EvalResult:
        return M.EvalResult(metrics=gen.evaluate(task.step, engines=task.engines, judges=task.judges))

    try:
        serve(ctx, comm, {"start_engines": start_engines, "generate": lambda task: generate(gen, task),
                          "eval": evaluate, "stop": lambda task: M.StopResult()})
    finally:
        gen.close()
        announce.close()


if __name__ == "__main__":
    sys.exit(main(ROLE, work))
