"""Where each role runs: which het component (role group) it owns or shares, and how many ranks it has.

Both the sbatch renderer (one ``#SBATCH`` block per component) and the controller (one
``srun --het-group=K`` per role) read this, so they can never disagree about the layout. In the ``single``
layout (``slurm.layout``) the groups are consecutive slices of one allocation's nodes: group K starts at node
:attr:`RoleStep.node_offset` (``srun --relative``), in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from relax_hpc.recipe.schema import ROLE_NAMES, Recipe, RoleGroup


@dataclass(frozen=True)
class RoleStep:
    role: str  # actor, rollout, reference, actor_fwd
    het_group: int  # index of the het component it runs in
    group: RoleGroup  # resources of that component (the host's when shared)
    shared: bool  # runs as an extra step in another role's component (srun --overlap)
    nodes: int
    tasks_per_node: int
    overlap: bool = False  # shares its nodes with steps started later (the rollout driver: the engine steps)
    node_offset: int = 0  # single layout: its group's first node in the allocation (the groups before it, summed)

    @property
    def ntasks(self) -> int:
        return self.nodes * self.tasks_per_node


def role_steps(recipe: Recipe) -> list[RoleStep]:
    """Enabled roles in het-group order; a role with ``share_with`` gets its host's component."""
    owners: dict[str, int] = {}
    steps: list[RoleStep] = []
    for name in ROLE_NAMES:
        g = recipe.role(name)
        if g.enabled and g.share_with is None:
            owners[name] = len(owners)
            if name == "rollout":  # the driver: one task; the engines are steps of their own (initial_engines)
                steps.append(RoleStep(name, owners[name], g, False, 1, 1, overlap=True))
            else:
                steps.append(RoleStep(name, owners[name], g, False, g.nodes, g.tasks_per_node))
    for name in ROLE_NAMES:
        g = recipe.role(name)
        if g.enabled and g.share_with is not None:
            host = recipe.role(g.share_with)
            one = name == "rollout"  # the driver, as above
            steps.append(RoleStep(name, owners[g.share_with], host, True, 1 if one else g.nodes,
                                  1 if one else g.tasks_per_node))
    offsets, at = {}, 0
    for s in sorted((s for s in steps if not s.shared), key=lambda s: s.het_group):
        offsets[s.het_group], at = at, at + s.group.nodes
    steps = [replace(s, node_offset=offsets[s.het_group]) for s in steps]
    return sorted(steps, key=lambda s: (s.het_group, s.shared))


def one_component(recipe: Recipe) -> bool:
    """Every role runs in one component (e.g. colocate with no other role): the job is a plain one, whatever
    ``slurm.layout`` says (steps naming ``--het-group=0`` would find no het component to run on)."""
    return len({st.het_group for st in role_steps(recipe)}) == 1


def initial_engines(recipe: Recipe) -> list[str]:
    """The rollout engines a run starts with, ``engine0`` … : one per task slot of rollout's nodes
    (``nodes × tasks_per_node``), or of its first ``elastic.initial`` nodes (the rest are spare, for scale-out).
    Each is a job step of its own, started by the controller (:func:`relax_hpc.controller.steps.start_engine_step`)."""
    g = recipe.roles.rollout
    if not g.enabled:
        return []
    nodes = g.elastic.initial if g.elastic is not None else g.nodes
    return [f"engine{k}" for k in range(nodes * g.tasks_per_node)]


def engine_node(recipe: Recipe, name: str) -> int | None:
    """The node, counted within rollout's component, of the run's own engine ``engineK``: the K-th task slot's
    (``K // tasks_per_node``), as the component fills them; None for any other engine (a scale-out's or an attached
    one goes where there is room). With ``share_with: actor`` the component is the actor's, so engine K sits on the
    actor's node ``K // tasks_per_node``: multi-node colocate has engines on every actor node, each getting its
    weights from that node's actor ranks."""
    if not (name.startswith("engine") and name[6:].isdigit()):
        return None
    return int(name[6:]) // max(1, recipe.roles.rollout.tasks_per_node)


def het_groups(recipe: Recipe) -> list[RoleStep]:
    """One entry per het component (its owning role), in component order."""
    return [s for s in role_steps(recipe) if not s.shared]


def total_nodes(recipe: Recipe) -> int:
    """The nodes of every group together: the ``single`` layout's one allocation."""
    return sum(s.group.nodes for s in het_groups(recipe))
