"""Render a recipe into the sbatch script of its one job: a heterogeneous job (``slurm.layout: hetjob``, a
component per role group) or one homogeneous allocation of all the groups' nodes (``single``).

Why a module of its own: the script is the only text relax_hpc hands to a shell, so the rule "nothing from a
recipe reaches a shell unquoted" is enforced here, in one place. The Jinja2 environment quotes *every*
``{{ expression }}`` on output (``finalize``), not only those a template author remembered to filter, refuses
undefined names (StrictUndefined), and refuses values with line breaks (they would end an ``#SBATCH`` line).
A user's own template (``slurm.template``) gets the same environment and the same variables.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import jinja2

import relax_hpc
from relax_hpc.recipe import Recipe, RecipeError
from relax_hpc.launch.layouts import layout_of
from relax_hpc.launch.places import mem_mb
from relax_hpc.recipe.layout import het_groups, role_steps, total_nodes
from relax_hpc.rundir import MASK

PACKAGE_ROOT = Path(relax_hpc.__file__).resolve().parents[1]  # put on PYTHONPATH: the job imports this relax_hpc
SBATCH_DIR = Path(relax_hpc.__file__).resolve().parent / "sbatch"  # package data: the wheel carries it
DEFAULT_TEMPLATE = "hetjob.sbatch.j2"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Shell(str):
    """Text already safe for the shell (quoted, or a literal we wrote); ``finalize`` leaves it alone."""


class RenderError(ValueError):
    """A value the renderer refuses to put in a script (a template bug or a value that slipped past validation)."""


def shquote(value: Any) -> Shell:
    """``shlex.quote`` for any value; idempotent on already-quoted text."""
    if isinstance(value, Shell):
        return value
    if value is None:
        raise RenderError("the template printed an empty value (None); guard it with {% if ... %}")
    if isinstance(value, bool):
        raise RenderError(f"the template printed a boolean ({value}); use it in {{% if %}} instead")
    text = str(value)
    if any(c in text for c in "\n\r\0"):
        raise RenderError(f"refusing a value with a line break or NUL byte: {text!r}")
    return Shell(shlex.quote(text))


def shjoin(values: Iterable[Any]) -> Shell:
    """An argument list as one shell command line, each argument quoted."""
    return Shell(" ".join(shquote(v) for v in values))


def envname(name: Any) -> Shell:
    """An environment variable name; cannot be quoted, so it must be a plain identifier."""
    if not isinstance(name, str) or not _ENV_NAME.match(name):
        raise RenderError(f"refusing environment variable name {name!r}: letters, digits and '_' only")
    return Shell(name)


def _finalize(value: Any) -> Any:
    return shquote(value)


def make_environment(search_path: Iterable[Path]) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(p) for p in search_path]),
        undefined=jinja2.StrictUndefined,
        finalize=_finalize,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters.update(shquote=shquote, shjoin=shjoin, envname=envname)
    return env


@dataclass(frozen=True)
class Group:
    """One het component: what its ``#SBATCH`` block asks for."""

    het_group: int
    roles: tuple[str, ...]  # the owning role first, then roles sharing its nodes
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    time: str
    nodes: int
    ntasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int
    mem: str | None
    extra: tuple[str, ...]

    @property
    def label(self) -> str:
        return "+".join(self.roles)

    @property
    def role(self) -> str:
        return self.roles[0]


def groups_of(recipe: Recipe) -> list[Group]:
    s = recipe.slurm
    steps = role_steps(recipe)
    out = []
    for owner in het_groups(recipe):
        g = owner.group
        roles = tuple(st.role for st in steps if st.het_group == owner.het_group)
        out.append(Group(owner.het_group, roles, s.partition, s.account, s.qos, s.constraint, s.time,
                         g.nodes, g.tasks_per_node, g.cpus_per_task, g.gpus_per_node, g.mem, tuple(s.sbatch_extra)))
    return out


def single_group(recipe: Recipe) -> Group:
    """The ``single`` layout's one block: every group's nodes, each node as big as the biggest group's node needs
    (one task per node with all of its CPUs: the steps place their own tasks, ``srun --relative``), so any role's
    steps fit on any of its nodes. A homogeneous allocation: a CPU-only group's nodes get the GPUs too."""
    groups = groups_of(recipe)
    mems = [g.mem for g in groups if g.mem]
    return Group(0, tuple(r for g in groups for r in g.roles), groups[0].partition, groups[0].account, groups[0].qos,
                 groups[0].constraint, groups[0].time, total_nodes(recipe), 1,
                 max(g.ntasks_per_node * g.cpus_per_task for g in groups), max(g.gpus_per_node for g in groups),
                 max(mems, key=mem_mb) if mems else None, groups[0].extra)


def template_context(recipe: Recipe, run_dir: Path, command: list[str], pythonpath: str) -> dict[str, Any]:
    """Everything a template may use (documented in docs/cli.md)."""
    run_dir = Path(run_dir)
    logs = run_dir / "logs"
    s = recipe.slurm
    layout, why = layout_of(recipe)
    return {
        "recipe": recipe,
        "layout": layout,  # hetjob | single (slurm.layout, auto settled)
        "layout_why": why,
        "run": run_dir.name,
        "run_dir": str(run_dir),
        "logs_dir": str(logs),
        "job_name": s.job_name or f"relax-{recipe.run.name}",
        "output": str(logs / "batch-%j.out"),
        "error": str(logs / "batch-%j.err"),
        "requeue": s.requeue,
        "signal_lead_s": s.signal_lead_s,
        "groups": groups_of(recipe) if layout == "hetjob" else [single_group(recipe)],
        # single: each group's first node and node count in the one allocation (het_group, node_offset, group.nodes)
        "node_groups": [{"het_group": s.het_group, "node_offset": s.node_offset, "nodes": s.group.nodes}
                        for s in het_groups(recipe)],
        # slurm.env's names, each value masked: the values are secrets (relax_hpc.rundir.split_secrets), kept out of
        # the script (RUN/job.sbatch, sbatch's copy); the launcher's task sets them from RUN/secrets.json
        "env": {k: MASK for k in s.env},
        "command": list(command),
        "python": command[0],
        "pythonpath": pythonpath,
    }


def resolve_template(name: str | None, search: Iterable[Path] = ()) -> Path:
    """The template file: the default, or ``slurm.template`` as given (absolute), relative to one of
    ``search`` (the working directory, the recipe's directory), or a file name under ``relax_hpc/sbatch/``."""
    if not name:
        return SBATCH_DIR / DEFAULT_TEMPLATE
    p = Path(name).expanduser()
    candidates = [p] if p.is_absolute() else [Path(d) / p for d in search] + [SBATCH_DIR / p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise RecipeError([("slurm.template", name, f"no such template file (looked at: {tried}). "
                        "Fix: give a path to a Jinja2 sbatch template, or leave it empty for the default")])


def render_script(recipe: Recipe, run_dir: Path, command: list[str], pythonpath: str,
                  search: Iterable[Path] = ()) -> str:
    """The sbatch script for ``recipe`` in ``run_dir`` whose body execs ``command``.

    Raises :class:`RecipeError` naming ``slurm.template`` when the template is missing or broken, so the CLI
    reports it like any other recipe problem, before anything is submitted."""
    path = resolve_template(recipe.slurm.template, search)
    key = "slurm.template" if recipe.slurm.template else "<sbatch template>"
    env = make_environment([path.parent])
    try:
        text = env.get_template(path.name).render(template_context(recipe, run_dir, command, pythonpath))
    except jinja2.TemplateSyntaxError as e:
        raise RecipeError([(key, str(path), f"template syntax error at line {e.lineno}: {e.message}")]) from None
    except jinja2.UndefinedError as e:
        raise RecipeError([(key, str(path), f"template uses an unknown variable: {e.message}. "
                            "Fix: use only the variables listed in docs/cli.md")]) from None
    except RenderError as e:
        raise RecipeError([(key, str(path), f"{e}")]) from None
    if not text.startswith("#!"):
        raise RecipeError([(key, str(path), "the rendered script must start with a #! line (sbatch requires it)")])
    return text
