"""Starting an inference engine on this node: every rollout engine's host (:mod:`relax_hpc.roles.engine`) and every
rank of the frozen-engine roles (genrm's judges, the OPD teacher's engines) do it.

A frozen-engine role (:func:`start_frozen_engine`, :func:`serve_frozen_engines`) starts its rank's engine before the
bootstrap (it loads while torch is imported), registers it for cleanup at once, and after the bootstrap gathers
every rank's ``(name, url, pid, node)`` so rank 0 can report the whole set to the controller (task
``start_engines``); then it serves tasks until ``stop``. Its engines are seeded with ``run.seed`` and never get
weight syncs. The engine is SGLang on a GPU node with ``RELAX_SGLANG_PYTHON`` set, else relax_hpc's CPU engine;
either answers only requests carrying the run's API key.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from relax_hpc.roles.runtime import resolve
from relax_hpc.stores import listen_address

if TYPE_CHECKING:
    from relax_hpc.recipe.schema import RoleGroup
    from relax_hpc.roles.runtime import RoleContext
    from relax_hpc.rundir import RunDir

ENGINE_READY_S = 900.0


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def start_rank_engine(ctx: RoleContext, group: RoleGroup, model_path: str, *, seed: int, prefix: str,
                      sglang_args: list[str] | tuple[str, ...] = ()) -> Any:
    """This rank's engine serving ``model_path``, started (not yet ready), its log ``RUN_DIR/logs/<prefix><rank>.log``.

    ``seed``: the engine's sampling seed (requests that carry their own ``sampling_seed`` do not depend on it).
    ``sglang_args``: extra ``sglang.launch_server`` arguments (``rollout.engine.args``); the CPU engine takes none
    and says so in the role's log."""
    i = ctx.ident
    h = start_node_engine(ctx.run, group, model_path, name=f"{prefix}{i.rank}", local=i.node == "localhost",
                          local_rank=i.local_rank, seed=seed, sglang_args=sglang_args)
    ctx.add_cleanup(lambda: h.stop(timeout=5.0))  # also on SIGTERM (the controller gives 10 s) and controller loss
    return h


def start_node_engine(run: RunDir, group: RoleGroup, model_path: str, *, name: str, local: bool, local_rank: int,
                      seed: int, sglang_args: list[str] | tuple[str, ...] = (), kind: str = "auto") -> Any:
    """Engine ``name`` on this node (log ``RUN_DIR/logs/<name>.log``): SGLang on the ``local_rank``-th share of this
    node's GPUs, or the reference engine (on this node's GPU when there is one); it answers only requests carrying
    the run's API key. ``kind``: ``rollout.engine.kind`` (:func:`engine_kind`). ``local``: no Slurm, listen on the
    loopback only (:func:`engine_listen_host`). The start of every rollout engine (:mod:`relax_hpc.roles.engine`),
    and of each rank's engine of a frozen-engine role (genrm, teacher)."""
    from relax_hpc.engines.launcher import start_engine

    host = engine_listen_host(local)
    logf = run.logs / f"{name}.log"
    key = run.api_key()  # every engine of the run answers only requests that carry it
    gpus = max(1, group.gpus_per_node // max(1, group.tasks_per_node))
    first = local_rank * gpus
    # an engine step given its GPUs (--gres) sees Slurm's choice in CUDA_VISIBLE_DEVICES: keep it
    env = ({} if os.environ.get("SLURM_STEP_GPUS") and os.environ.get("CUDA_VISIBLE_DEVICES")
           else {"CUDA_VISIBLE_DEVICES": ",".join(str(first + k) for k in range(gpus))})
    if engine_kind(kind) == "sglang":
        return start_engine("sglang", resolve(model_path), tp=gpus, host=host, env=env, log_path=logf, api_key=key,
                            extra_args=["--weight-version", "0", "--random-seed", str(seed), *sglang_args])
    if sglang_args:
        print(f"[{name}] rollout.engine.args {list(sglang_args)} are SGLang's; the reference engine on this node (no "
              "CUDA, or no RELAX_SGLANG_PYTHON) does not take them", file=sys.stderr, flush=True)
    # the reference engine takes its share of GPUs only where the role was given some (a local run on a one-GPU box
    # gives none: the engine and the actor share device 0)
    return start_engine("reference", resolve(model_path), host=host, env=env if group.gpus_per_node else {},
                        log_path=logf, api_key=key,
                        extra_args=["--weight-version", "0", "--seed", str(seed), "--device", "auto",
                                    "--threads", str(max(1, group.cpus_per_task))])


def engine_kind(kind: str) -> str:
    """The engine this node runs for ``rollout.engine.kind``: ``sglang`` needs ``RELAX_SGLANG_PYTHON`` and CUDA here
    (else a clear error), ``reference`` is relax_hpc's own server, ``auto`` is SGLang where both are there."""
    sglang = bool(os.environ.get("RELAX_SGLANG_PYTHON"))
    if kind == "sglang" and not (sglang and has_cuda()):
        why = "RELAX_SGLANG_PYTHON is not set" if not sglang else "this node has no CUDA device"
        raise RuntimeError(f"rollout.engine.kind: sglang, but {why} on {socket.gethostname()}. Fix: run the engines on "
                           "GPU nodes with RELAX_SGLANG_PYTHON set to an SGLang environment's python (docs/engines.md), "
                           "or rollout.engine.kind: reference")
    if kind == "sglang" or (kind == "auto" and sglang and has_cuda()):
        return "sglang"
    return "reference"


def engine_listen_host(local: bool) -> str:
    """Where this node's engine listens: 127.0.0.1 in a local run; under Slurm the node's IPv4 address (what its
    name resolves to, which other nodes reach), so the engine is not on the node's other interfaces; every
    interface only where the name resolves to a loopback address or not at all
    (:func:`relax_hpc.stores.listen_address`)."""
    if local:
        return "127.0.0.1"
    where = listen_address(socket.gethostname())
    return where[1] if where is not None and where[0] == socket.AF_INET else "0.0.0.0"


def gather_engines(ctx: RoleContext, engine: Any, prefix: str) -> list[tuple[str, str, int, str]]:
    """Wait for this rank's engine, then every rank's ``(name, url, pid, node)``, names ``<prefix><rank>``."""
    import torch.distributed as dist

    i = ctx.ident
    engine.wait_ready(ENGINE_READY_S)
    everyone: list[Any] = [None] * i.world
    dist.all_gather_object(everyone, (f"{prefix}{i.rank}", engine.url, engine.pid, i.node))
    ctx.report("ready", engine=engine.url)
    return [tuple(e) for e in everyone]


def start_engines_result(everyone: list[tuple[str, str, int, str]]) -> Any:
    """The ``start_engines`` result of :func:`gather_engines`' list."""
    from relax_hpc.controller.messages import StartEnginesResult

    return StartEnginesResult(engines={n: u for n, u, _, _ in everyone}, pids={n: p for n, _, p, _ in everyone},
                              nodes={n: node for n, _, _, node in everyone})


def start_frozen_engine(ctx: RoleContext, role: str, model_path: str | None, key: str, prefix: str) -> Any:
    """This rank's engine of frozen-engine role ``role`` (``roles.<role>``), serving ``model_path`` (recipe key
    ``key``), seeded with ``run.seed``, named ``<prefix><rank>``: the role's ``prepare``."""
    r = ctx.recipe
    if model_path is None:
        raise ValueError(f"roles.{role} is enabled but {key} is not set: its engines have no model. Fix: set {key} "
                         f"to the model's directory, or disable roles.{role}")
    return start_rank_engine(ctx, r.role(role), model_path, seed=r.run.seed, prefix=prefix)


def serve_frozen_engines(ctx: RoleContext, comm: Any, prefix: str) -> None:
    """A frozen-engine role's work: wait for every rank's engine (``ctx.prepared``), report them all at
    ``start_engines``, serve until ``stop``; the engine stops on the way out, whatever happened."""
    from relax_hpc.controller import messages as M
    from relax_hpc.roles.tasks import serve

    engine = ctx.prepared
    try:
        everyone = gather_engines(ctx, engine, prefix)
        serve(ctx, comm, {"start_engines": lambda task: start_engines_result(everyone),
                          "stop": lambda task: M.StopResult()})
    finally:
        engine.stop()
