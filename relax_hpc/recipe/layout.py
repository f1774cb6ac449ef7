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
            nodes = g.elastic.initial if g.elastic is not None else g.nodes  # the rest: spare, for scale-out
            steps.append(RoleStep(name, owners[name], g, False, nodes, g.tasks_per_node))
    for name in ROLE_NAMES:
        g = recipe.role(name)
        if g.enabled and g.share_with is not None:
            host = recipe.role(g.share_with)
            steps.append(RoleStep(name, owners[g.share_with], host, True, g.nodes, g.tasks_per_node))
    return sorted(steps, key=lambda s: (s.het_group, s.shared))


def het_groups(recipe: Recipe) -> list[RoleStep]:
    """One entry per het component (its owning role), in component order."""
    return [s for s in role_steps(recipe) if not s.shared]
