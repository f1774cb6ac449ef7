"""Communicators of a role step: rendezvous, the role's torch.distributed group, and the cross-role group.

Rendezvous: rank 0 opens a ``TCPStore`` on port 0 (the kernel picks a free port, so two runs on one node
never collide) and tells the others where it is: through MPI (``RELAX_RENDEZVOUS=mpi``: the step runs
under ``srun --mpi=pmix``; mpi4py, the ``[mpi]`` extra, is imported only then) or through
``RUN_DIR/rendezvous/<role>.json`` (``file``: the default, ``slurm.mpi: none``, and local runs; no MPI needed). The file carries the step's launch id, so a file left by
an earlier attempt is never used. Then ``init_process_group`` (NCCL with GPUs, gloo without) and a check:
an all_reduce of the ranks and an all_gather of node names.

Cross-role group: actor rank 0 plus rank 0 of every other role, a check at the run's start that every role can
reach the actor (an all_reduce), nothing more: no role needs a group with the actor afterwards (the weights travel
in the actor's own weight-sync group, :mod:`relax_hpc.weights`; work and results through the controller and the
exchange). So the group is left at the end without a collective, and a role started again alone (the role tier of
recovery, ``RELAX_RESTARTED_ALONE``) does not rejoin it: it rejoins only its own group, the controller and the
exchange, and the actor keeps its process. The actor opens a store on port 0 and publishes its address through
the controller; the others look it up and join a separate gloo group built straight on that store
(``dist.new_group`` cannot span separate jobs). Every wait here is bounded by ``logging.heartbeat_timeout_s``.

Where a store listens: a TCPStore takes any connection and asks for no key, and torch's server listens on every
interface when no socket is given. :func:`~relax_hpc.stores.master_store` binds the address the run uses instead:
127.0.0.1 in ``--local`` runs, the node's address under Slurm (the one its name resolves to).
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from relax_hpc.identity import cross_members, reachable_host
from relax_hpc.rundir import write_json
from relax_hpc.stores import master_store

if TYPE_CHECKING:  # torch-free leaf; for hints only
    from relax_hpc.roles.context import RoleContext

CROSS_KEY = "cross_group"


@dataclass
class Comm:
    rank: int
    world: int
    backend: str
    collective_ok: bool
    nodes: list[str]
    cross_world: int | None = None  # set on the cross group's members (rank 0 of each role)
    cross_ok: bool | None = None
    cross_group: Any = None  # ProcessGroupGloo of the start's check (kept alive, never used again)
    _stores: list = field(default_factory=list)  # a store must outlive the groups built on it

    def summary(self) -> dict:
        out = {"backend": self.backend, "collective_ok": self.collective_ok, "nodes": self.nodes}
        if self.cross_world is not None:
            out["cross_group"] = {"world": self.cross_world, "ok": self.cross_ok}
        return out

    def close(self) -> None:
        """Leave together: rank 0 holds the store, so it must not go while others still use it. The cross-role group
        is not waited on: a role started again alone is not in it, and no one uses it after the start's check."""
        self.cross_group = None
        dist.barrier()
        dist.destroy_process_group()
        self._stores.clear()


def _store(host: str, port: int, world: int, master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    if master:
        return master_store(host, world, timeout)
    return dist.TCPStore(host, port, world, is_master=False, timeout=timeout, wait_for_workers=False)


def _rendezvous(ctx: RoleContext, timeout: datetime.timedelta) -> dist.TCPStore:
    i = ctx.ident
    how = os.environ.get("RELAX_RENDEZVOUS") or ("mpi" if "PMIX_RANK" in os.environ else "file")
    store = _store(reachable_host(i), 0, i.world, True, timeout) if i.rank == 0 else None
    addr = (reachable_host(i), store.port) if store is not None else None
    if how == "mpi":
        from mpi4py import MPI  # only under srun --mpi=pmix: importing it initializes MPI

        comm = MPI.COMM_WORLD
        if (comm.Get_rank(), comm.Get_size()) != (i.rank, i.world):
            raise RuntimeError(f"MPI sees rank {comm.Get_rank()}/{comm.Get_size()}, Slurm {i.rank}/{i.world}")
        addr = comm.bcast(addr, root=0)
    elif how == "file":
        path = ctx.run.rendezvous / f"{i.role}.json"
        if i.rank == 0:
            write_json(path, {"host": addr[0], "port": addr[1], "launch_id": ctx.launch_id})
        else:
            addr = _wait_for_file(ctx, path, timeout.total_seconds())
    else:
        raise RuntimeError(f"RELAX_RENDEZVOUS={how!r}: must be mpi or file")
    return store if store is not None else _store(addr[0], addr[1], i.world, False, timeout)


def _wait_for_file(ctx: RoleContext, path, wait_s: float) -> tuple[str, int]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        data = ctx.run.read_json(path)
        if data and data.get("launch_id") == ctx.launch_id:
            return data["host"], int(data["port"])
        time.sleep(0.05)
    raise TimeoutError(f"rank 0 of {ctx.ident.role} did not write {path} within {wait_s:.0f}s")


def _cross_group(ctx: RoleContext, comm: Comm, timeout: datetime.timedelta) -> None:
    members = cross_members(ctx.recipe)
    me, size = members.index(ctx.ident.role), len(members)
    if ctx.ident.role == "actor":
        store = _store(reachable_host(ctx.ident), 0, size, True, timeout)
        ctx.client.publish(CROSS_KEY, {"host": reachable_host(ctx.ident), "port": store.port, "world": size})
    else:
        addr = ctx.client.lookup(CROSS_KEY, wait_s=timeout.total_seconds())
        store = _store(addr["host"], int(addr["port"]), size, False, timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore("cross", store), me, size, timeout)
    x = torch.tensor([float(me)])
    group.allreduce([x]).wait()
    comm._stores.append(store)
    comm.cross_group, comm.cross_world, comm.cross_ok = group, size, x.item() == size * (size - 1) / 2
    if not comm.cross_ok:
        raise RuntimeError(f"cross-role check all_reduce gave {x.item()}, expected {size * (size - 1) / 2}")


def bootstrap(ctx: RoleContext) -> Comm:
    i = ctx.ident
    timeout = datetime.timedelta(seconds=ctx.recipe.logging.heartbeat_timeout_s)
    store = _rendezvous(ctx, timeout)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(i.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, store=store, rank=i.rank, world_size=i.world, timeout=timeout)
    x = torch.tensor([float(i.rank)], device=device)
    dist.all_reduce(x)
    nodes: list[Any] = [None] * i.world
    dist.all_gather_object(nodes, i.node)
    expected = i.world * (i.world - 1) / 2
    comm = Comm(i.rank, i.world, backend, x.item() == expected, nodes, _stores=[store])
    if not comm.collective_ok:
        raise RuntimeError(f"check all_reduce gave {x.item()}, expected {expected}")
    if i.rank == 0 and not os.environ.get("RELAX_RESTARTED_ALONE"):  # the check needs every role's rank 0
        _cross_group(ctx, comm, timeout)
    return comm
