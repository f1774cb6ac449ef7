"""Does a valid recipe fit the place it will run: the cluster's nodes (from ``sinfo``) or this machine (CUDA).

Pure checks, each backend's own (:meth:`~relax_hpc.backends.Backend.place_problems` runs them; the caller
supplies ``sinfo``'s data or a CUDA count). Problems are (key, value, message-with-fix) triples, like the
validator's.
"""

from __future__ import annotations

import re
from typing import Callable

from relax_hpc.launch import slurm
from relax_hpc.recipe import Recipe
from relax_hpc.recipe.layout import het_groups, role_steps

Problem = tuple[str, object, str]


def mem_mb(text: str) -> int:
    """Slurm memory syntax → MiB ('16G' → 16384, '4000' → 4000: Slurm's default unit is MB)."""
    m = re.match(r"^(\d+)([KMGT]?)$", text.strip().upper())
    if not m:
        raise ValueError(f"not Slurm memory syntax: {text!r}")
    n, unit = int(m.group(1)), m.group(2) or "M"
    return {"K": n // 1024, "M": n, "G": n * 1024, "T": n * 1024 * 1024}[unit]


def check_slurm(recipe: Recipe, nodes: list[slurm.Node], default: str | None) -> list[Problem]:
    """Does every het component fit the partition's nodes? Pure: the caller supplies ``sinfo`` data."""
    problems: list[Problem] = []
    known = sorted({p for n in nodes for p in n.partitions})
    part = recipe.slurm.partition or default
    if part is None:
        return [("slurm.partition", None, "no partition given and the cluster has no default partition. "
                 f"Fix: set slurm.partition to one of: {', '.join(known) or '(none found)'}")]
    if part not in known:
        return [("slurm.partition", part, f"no such partition on this cluster. Fix: use one of "
                 f"{', '.join(known) or '(none found)'}" + (f" (default: {default})" if default else ""))]
    pnodes = [n for n in nodes if part in n.partitions]
    where = f"partition {part}" + ("" if recipe.slurm.partition else " (the cluster's default)")
    with_gpus = sorted({p for n in nodes if n.gpus for p in n.partitions})
    max_gpus = max(n.gpus for n in pnodes)
    max_cpus = max(n.cpus for n in pnodes)
    max_mem = max(n.memory_mb for n in pnodes)
    for step in het_groups(recipe):
        g, key = step.group, f"roles.{step.role}"
        before = len(problems)
        if g.nodes > len(pnodes):
            problems.append((f"{key}.nodes", g.nodes, f"{where} has only {len(pnodes)} node(s). "
                             f"Fix: ask for at most {len(pnodes)}, or use a bigger partition"))
        if g.gpus_per_node > 0 and max_gpus == 0:
            alt = f" (partitions with GPUs: {', '.join(with_gpus)})" if with_gpus else ""
            problems.append((f"{key}.gpus_per_node", g.gpus_per_node,
                             f"no GPUs on {where}. Fix: set 0 for CPU nodes, or choose a partition with GPUs{alt}"))
        elif g.gpus_per_node > max_gpus:
            problems.append((f"{key}.gpus_per_node", g.gpus_per_node,
                             f"nodes of {where} have at most {max_gpus} GPUs. "
                             f"Fix: ask for at most {max_gpus} per node and use more nodes"))
        cpus = g.tasks_per_node * g.cpus_per_task
        if cpus > max_cpus:
            problems.append((f"{key}.cpus_per_task", g.cpus_per_task,
                             f"tasks_per_node × cpus_per_task = {g.tasks_per_node} × {g.cpus_per_task} = {cpus} "
                             f"CPUs per node, but nodes of {where} have at most {max_cpus}. Fix: fewer tasks or CPUs per node"))
        try:
            need_mem = mem_mb(g.mem) if g.mem else 0
        except ValueError:  # refused by the validator already (it names roles.<role>.mem)
            need_mem = 0
        if need_mem > max_mem:
            problems.append((f"{key}.mem", g.mem, f"nodes of {where} have at most {max_mem} MB. "
                             "Fix: ask for less, or leave it empty for the partition default"))
        if len(problems) == before:  # each need fits some node; do enough nodes fit all of them at once?
            fit = [n for n in pnodes if n.gpus >= g.gpus_per_node and n.cpus >= cpus and n.memory_mb >= need_mem]
            if len(fit) < g.nodes:
                problems.append((f"{key}.nodes", g.nodes,
                                 f"only {len(fit)} node(s) of {where} have {g.gpus_per_node} GPUs, {cpus} CPUs "
                                 f"and {need_mem} MB together. Fix: fewer nodes or smaller nodes"))
    problems += _check_distinct_nodes(recipe, len(pnodes), where, problems)
    return problems


def _check_distinct_nodes(recipe: Recipe, available: int, where: str, found: list[Problem]) -> list[Problem]:
    """Slurm never places two components of one het job on the same node (seen on 22.05: a 2+1+1+1 job on
    4 idle nodes stays PENDING (Resources) for ever), so the components' node counts add up."""
    groups = het_groups(recipe)
    total = sum(s.group.nodes for s in groups)
    if total <= available or any(k.endswith(".nodes") for k, _, _ in found):
        return []
    running = 0
    for s in groups:
        running += s.group.nodes
        if running > available:
            sizes = "+".join(str(g.group.nodes) for g in groups)
            return [(f"roles.{s.role}.nodes", s.group.nodes,
                     f"the het components need {sizes} = {total} nodes but {where} has {available}: Slurm never puts "
                     "two components of one heterogeneous job on the same node, so the job would wait for ever. "
                     f"Fix: fewer nodes, or run {s.role} on another role's nodes (roles.{s.role}.share_with)")]
    return []


def check_local(recipe: Recipe, cuda_devices: Callable[[], int]) -> list[Problem]:
    """Local runs: GPUs asked for must exist on this machine. ``cuda_devices`` is only called if GPUs are asked."""
    asking = [s for s in role_steps(recipe) if not s.shared and s.group.gpus_per_node > 0]
    if not asking:
        return []
    have = cuda_devices()
    problems: list[Problem] = []
    for step in asking:
        n, key = step.group.gpus_per_node, f"roles.{step.role}.gpus_per_node"
        if have == 0:
            problems.append((key, n, "the local executor runs on this machine, which has no CUDA GPU. "
                             "Fix: set 0 for a CPU run, or submit to Slurm (without --local)"))
        elif n > have:
            problems.append((key, n, f"this machine has {have} CUDA GPU(s). Fix: ask for at most {have}"))
    return problems


def cuda_device_count() -> int:
    try:
        import torch  # only imported when a local recipe asks for GPUs: it takes seconds
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
