#!/usr/bin/env python3
"""Start-up time of the two rendezvous of a role step (run by hand on a Slurm cluster, not a test):

    tools/bench/rendezvous.py [--reps 5] [--nodes 2] [--dir RUNS_ROOT]

Per rep and per kind, one ``srun -N NODES -n NODES`` step: ``--mpi=pmix`` with the address broadcast by mpi4py
(``slurm.mpi: pmix``), and no ``--mpi`` flag with the address written to a file on the shared filesystem
(``slurm.mpi: none``, the default), the kinds interleaved. Each rank opens or joins rank 0's TCPStore as
:mod:`relax_hpc.roles.comm` does and reports the rendezvous (store open → every rank checked in, MPI_Init included)
and its process time (start → checked in, torch's import included); the driver reports srun's wall time. Medians
as JSON. ``--dir`` must be on a filesystem every node mounts (the run directory's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def rank_main(how: str, where: str) -> None:
    t0 = time.monotonic()
    import torch.distributed as dist

    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    store = dist.TCPStore("0.0.0.0", 0, world, is_master=True, wait_for_workers=False) if rank == 0 else None
    addr = (os.environ["SLURMD_NODENAME"], store.port) if store else None
    t1 = time.monotonic()
    if how == "mpi":
        from mpi4py import MPI  # initializes MPI (PMIx)

        addr = MPI.COMM_WORLD.bcast(addr, root=0)
    else:
        path = os.path.join(where, f"rdv-{os.environ['SLURM_JOB_ID']}-{os.environ['SLURM_STEP_ID']}.json")
        if rank == 0:
            with open(path + ".tmp", "w") as f:
                json.dump(addr, f)
            os.replace(path + ".tmp", path)
        else:
            while not os.path.exists(path):
                time.sleep(0.05)  # the poll of relax_hpc.roles.comm
            with open(path) as f:
                addr = tuple(json.load(f))
    if store is None:
        store = dist.TCPStore(addr[0], addr[1], world, is_master=False)
    store.set(f"r{rank}", "1")
    store.wait([f"r{r}" for r in range(world)])
    t2 = time.monotonic()
    print(json.dumps({"rank": rank, "rendezvous_s": t2 - t1, "process_s": t2 - t0}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--dir", default=os.getcwd(), help="a directory every node mounts (default: here)")
    ap.add_argument("--rank", choices=["mpi", "file"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        rank_main(args.rank, args.dir)
        return 0
    out: dict[str, dict[str, list[float]]] = {k: {"rendezvous_s": [], "process_s": [], "srun_s": []}
                                              for k in ("file", "mpi")}
    for _ in range(args.reps):
        for how in ("file", "mpi"):
            mpi = ["--mpi=pmix"] if how == "mpi" else []
            t = time.monotonic()
            p = subprocess.run(["srun", f"-N{args.nodes}", f"-n{args.nodes}", "--ntasks-per-node=1", "-t", "2", *mpi,
                                sys.executable, os.path.abspath(__file__), "--rank", how, "--dir", args.dir],
                               capture_output=True, text=True, timeout=300)
            wall = time.monotonic() - t
            if p.returncode != 0:
                print(p.stderr, file=sys.stderr)
                return 1
            ranks = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
            for key in ("rendezvous_s", "process_s"):
                out[how][key].append(max(r[key] for r in ranks))  # the step is ready when its last rank is
            out[how]["srun_s"].append(wall)
    print(json.dumps({how: {k: round(statistics.median(v), 2) for k, v in d.items()} for how, d in out.items()},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
