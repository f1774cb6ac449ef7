"""Who a role process is, and who belongs to the cross-role group: facts both sides of the control socket use.

The roles (:mod:`relax_hpc.roles.runtime`, :mod:`relax_hpc.roles.comm`) use them to bootstrap, the controller
(:mod:`relax_hpc.controller.state`) to know whom to expect. A leaf: it imports only the recipe, so neither side
imports the other for it, and only where :func:`cross_members` needs it: ``import relax_hpc.identity`` loads no
other relax_hpc module (the recipe's validator brings every package's config and checks).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_hpc.recipe import Recipe


@dataclass(frozen=True)
class Identity:
    role: str
    rank: int
    world: int
    local_rank: int
    node: str

    @classmethod
    def from_env(cls, role: str, env: dict[str, str] | None = None) -> "Identity":
        """The local launcher's ``RELAX_*`` variables win over Slurm's (a local run may sit inside an allocation)."""
        env = os.environ if env is None else env

        def pick(*names: str, default: str) -> str:
            return next((env[n] for n in names if env.get(n)), default)

        return cls(role=role,
                   rank=int(pick("RELAX_RANK", "SLURM_PROCID", default="0")),
                   world=int(pick("RELAX_WORLD_SIZE", "SLURM_NTASKS", default="1")),
                   local_rank=int(pick("RELAX_LOCAL_RANK", "SLURM_LOCALID", default="0")),
                   node=pick("RELAX_NODE", "SLURMD_NODENAME", default=socket.gethostname()))


def cross_members(recipe: Recipe) -> list[str]:
    """Ranks of the cross-role group, in order: the actor (its rank 0), then rank 0 of every other role."""
    from relax_hpc.recipe.layout import role_steps

    return ["actor", *[s.role for s in role_steps(recipe) if s.role != "actor"]]


def reachable_host(ident: Identity) -> str:
    """The address other processes use to reach a listener here: the node's name where it resolves."""
    if ident.node == "localhost":
        return "127.0.0.1"
    try:
        socket.getaddrinfo(ident.node, None)
        return ident.node
    except OSError:
        return socket.getfqdn()
