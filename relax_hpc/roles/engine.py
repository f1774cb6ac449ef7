"""One rollout engine and its host: a job step of its own (origin ``initial``: the engines the run starts with;
``step``: added by scale-out), a task of an attached Slurm job (``attached``), or, without Slurm, a local process.
The controller starts the steps (:func:`relax_hpc.controller.steps.start_engine_step`, from
:mod:`relax_hpc.controller.elastic`); an attached job's script starts the tasks.

    python -m relax_hpc.roles.engine RUN_DIR --name NAME --origin ORIGIN --op OP

Why a program of its own: an engine is a unit the controller owns, not a rank of the rollout role. The rollout
role is the driver (data, requests, rewards); engines join and leave while it runs, so none of them can be part
of its collectives. A host only needs the run directory (recipe, API key, token, ``controller.json``): it starts
the engine from the model on disk, waits for it, and announces it to the controller (``engine_join``). A fresh
run's initial engines serve the model on disk, which is step 0's weights: they are ready at once. Any other
engine gets the current weights from the actor at the next sync (the weight-sync group is rebuilt with the new
member) and is given requests only once its weight version is within the staleness bound. Under ``srun`` of an
attached job one task is one engine: the name's last part is the task's ``SLURM_PROCID``.

After joining it long-polls the controller for its one task, ``stop`` (scale-in drained it, or the run ends), and
watches its engine. Signals are how Slurm takes capacity back:

- SIGUSR2 (``--signal=USR2@lead`` of the attached job: the time limit is near): ``engine_leave`` without ``now``;
  the controller drains it (no new requests, those in flight finish) and then sends ``stop``.
- SIGTERM (scancel, preemption, the controller stopping the step): ``engine_leave`` with ``now``; the engine is
  stopped at once, and the requests it had in flight fail over to the other engines, with their sampling seeds.

It exits when its engine dies (after telling the controller, which starts an engine of the run's own again),
when the controller stays unreachable for ``logging.heartbeat_timeout_s`` (the run is gone), or on ``stop``; its
engine is stopped by PID on the way out.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

log = logging.getLogger("relax_hpc.engine")
POLL_S = 2.0  # next_task long poll: how soon a signal or the engine's death is noticed


def _name(base: str) -> str:
    """``NAME`` as given, or ``NAME<procid>`` when it ends with ``-`` (one name per task of an attached job)."""
    return f"{base}{os.environ.get('SLURM_PROCID', '0')}" if base.endswith("-") else base


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relax_hpc.roles.engine")
    p.add_argument("run_dir")
    p.add_argument("--name", required=True)
    p.add_argument("--origin", choices=("initial", "step", "attached"), required=True)
    p.add_argument("--op", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [engine] %(levelname)s %(message)s")

    from relax_hpc.controller.protocol import Client, ProtocolError
    from relax_hpc.recipe import load_recipe
    from relax_hpc.roles.engine_host import ENGINE_READY_S, start_node_engine
    from relax_hpc.rundir import RunDir

    run = RunDir(Path(a.run_dir).resolve())
    recipe = load_recipe(run.recipe)
    name = _name(a.name)
    local = not os.environ.get("SLURM_JOB_ID")
    node = os.environ.get("SLURMD_NODENAME") or ("localhost" if local else socket.gethostname())
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    where = f"{job}.{step}" if job and step else ""
    signalled: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        signalled.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGUSR2, on_signal)
    # engine<k> (initial) keeps the seed rank k had when engines were the rollout role's ranks; others apart from
    # those; requests carry their own sampling seeds, so this only matters for requests without one
    k = name[len("engine"):]
    seed = recipe.run.seed + (int(k) if name.startswith("engine") and k.isdigit() else 10_000 + sum(map(ord, name)))
    engine = start_node_engine(run, recipe.roles.rollout, recipe.model.path, name=name, local=local,
                               local_rank=int(os.environ.get("SLURM_LOCALID", "0")), seed=seed,
                               sglang_args=_sglang_args(recipe), kind=recipe.rollout.engine.kind)
    try:
        engine.wait_ready(ENGINE_READY_S)
        if signalled:
            log.info("%s: %s before it joined; leaving", name, signalled[0])
            return 0
        addr = run.read_json(run.controller_addr, {}) or {}
        client = Client(addr["host"], int(addr["port"]), run.token(), timeout_s=15.0)
        client.engine_join(name, engine.url, engine.pid, node, a.origin, a.op, where)
        log.info("%s joined the run at %s (%s, op %s, %s)", name, engine.url, a.origin, a.op, where or "local")
        return _serve(client, name, engine, signalled, recipe.logging.heartbeat_timeout_s, ProtocolError)
    finally:
        engine.stop(timeout=5.0)


def _serve(client, name: str, engine, signalled: list[str], silence_s: float, ProtocolError: type) -> int:
    told = 0  # signals reported so far
    last_ok = time.monotonic()
    while True:
        if len(signalled) > told:
            sig, told = signalled[told], told + 1
            now = sig != "SIGUSR2"
            try:
                client.engine_leave(name, f"{sig} ({'time limit near' if not now else 'scancel or preemption'})", now)
            except (OSError, ProtocolError) as e:
                log.warning("%s: could not tell the controller about %s: %s", name, sig, e)
            if now:
                return 0
        if not engine.alive():
            why = f"its engine process exited with code {engine.returncode()}"
            log.error("%s: %s; last lines:\n%s", name, why, engine.log_tail(20))
            try:
                client.engine_leave(name, why, True)
            except (OSError, ProtocolError):
                pass
            return 1
        try:
            task = client.next_task(f"engine:{name}", 0, wait_s=POLL_S)
            last_ok = time.monotonic()
        except (OSError, ProtocolError) as e:
            if time.monotonic() - last_ok > silence_s:
                log.error("%s: the controller is unreachable for %.0f s (%s): the run is gone; stopping", name,
                          time.monotonic() - last_ok, e)
                return 0
            time.sleep(1.0)
            continue
        if task is not None and task.get("kind") == "stop":
            log.info("%s: stop (%s)", name, task.get("why", "the controller asked"))
            try:
                client.task_done(f"engine:{name}", 0, int(task["id"]), {})
            except (OSError, ProtocolError):
                pass
            return 0


def _sglang_args(recipe) -> list[str]:
    """``rollout.engine.args``, and what the run's keys ask of SGLang: the routed experts with routing replay
    (SGLang returns them only when started with this flag)."""
    from relax_hpc.roles.engine_host import engine_kind

    args = list(recipe.rollout.engine.args)
    sglang = engine_kind(recipe.rollout.engine.kind) == "sglang"  # the reference engine returns them when asked
    if sglang and recipe.train.routing_replay and "--enable-return-routed-experts" not in args:
        args.append("--enable-return-routed-experts")
    lora = recipe.train.lora
    if sglang and lora is not None and lora.mode == "adapter":  # the actor loads the adapters at run time
        from relax_hpc.engines.launcher import sglang_lora_args
        from relax_hpc.train.config import hf_lora_targets

        args += sglang_lora_args(lora.rank, hf_lora_targets(lora.target_modules))
    return args


if __name__ == "__main__":
    sys.exit(main())

