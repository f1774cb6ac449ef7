"""Where each role runs: which het component it owns or shares, and how many ranks it has.

Both the sbatch renderer (one ``#SBATCH`` block per component) and the controller (one
``srun --het-group=K`` per role) read this, so they can never disagree about the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    return sorted(steps, key=lambda s: (s.het_group, s.shared))


def initial_engines(recipe: Recipe) -> list[str]:
    """The rollout engines a run starts with, ``engine0`` … : one per task slot of rollout's nodes
    (``nodes × tasks_per_node``), or of its first ``elastic.initial`` nodes (the rest are spare, for scale-out).
    Each is a job step of its own, started by the controller (:func:`relax_hpc.controller.steps.start_engine_step`)."""
    g = recipe.roles.rollout
    if not g.enabled:
        return []
    nodes = g.elastic.initial if g.elastic is not None else g.nodes
    return [f"engine{k}" for k in range(nodes * g.tasks_per_node)]


def het_groups(recipe: Recipe) -> list[RoleStep]:
    """One entry per het component (its owning role), in component order."""
    return [s for s in role_steps(recipe) if not s.shared]
