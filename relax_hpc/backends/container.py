"""The container around a step (``slurm.container``): the srun options (pyxis) or the command prefix (Apptainer)
that run a role's or an engine's own command inside an image. docs/containers.md says why and how.

Only the steps go in: the controller stays on the host, where Slurm's client tools are (it starts every step
with ``srun``, and a container has neither those tools nor the munge socket they need), and it needs no GPU.
Inside, a step runs the image's Python (``python``), imports this checkout's relax_hpc through ``PYTHONPATH``
(its directory is mounted at its own path), and finds the run directory and the working directory at their host
paths, so every path on a command line means the same inside and out. Argument lists only: no shell.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path, PurePosixPath

import relax_hpc
from relax_hpc.errors import PermanentError
from relax_hpc.recipe.schema import ContainerConfig, Recipe

PACKAGE_ROOT = str(Path(relax_hpc.__file__).resolve().parents[1])  # the directory holding this relax_hpc
APPTAINER = "apptainer"
_APPTAINER_VALUED = ("--bind", "--env", "--pwd")  # the prefix's options that take a value (readable())


def workdir(c: ContainerConfig) -> str:
    """The steps' working directory inside: ``workdir``, else the host's (where relative recipe paths resolve)."""
    return c.workdir or os.getcwd()


def step_pythonpath(env: dict[str, str] | None = None) -> str:
    """The ``PYTHONPATH`` a step gets (like :func:`relax_hpc.controller.steps.pythonpath`): this relax_hpc first."""
    old = (os.environ if env is None else env).get("PYTHONPATH")
    return PACKAGE_ROOT + (os.pathsep + old if old else "")


def _identity(mount: str) -> str | None:
    """The path a writable mount brings in at its own path, else None."""
    src, dst, *flags = mount.split(":")
    return src if dst == src and flags != ["ro"] else None


def mounts(c: ContainerConfig, run_dir: Path) -> list[str]:
    """The recipe's mounts, then the run directory, relax_hpc's checkout and the working directory, each at its
    own path unless a mount of the same path (or a directory above it) already brings it."""
    if Path(PACKAGE_ROOT).name in ("site-packages", "dist-packages"):  # first on PYTHONPATH: the host's builds
        raise PermanentError(f"slurm.container: relax_hpc is installed in {PACKAGE_ROOT}, which cannot go into the "
                             "container (its other packages, built for the host, would shadow the image's). Fix: "
                             "run relax_hpc from a checkout (tools/install installs it editable)")
    out = list(c.mounts)
    for path in sorted({str(Path(run_dir).resolve()), PACKAGE_ROOT, workdir(c)}, key=len):  # outer ones first
        if any(c_ in path for c_ in ",:"):
            raise PermanentError(f"slurm.container: the path {path!r} contains ',' or ':', which separate mounts, "
                                 "so it cannot be mounted. Fix: a run directory, checkout and working directory "
                                 "without them")
        covered = [p for p in map(_identity, out) if p is not None]
        if not any(PurePosixPath(path) == PurePosixPath(p) or PurePosixPath(p) in PurePosixPath(path).parents
                   for p in covered):
            out.append(f"{path}:{path}")
    return out


def srun_options(recipe: Recipe, run_dir: Path) -> list[str]:
    """pyxis's srun options for a step (none for Apptainer, or without a container). The image's own value of a
    variable wins over the job's unless ``--container-env`` names it: ``PYTHONPATH`` (this relax_hpc) and
    ``env``'s names are named; ``env``'s values are in srun's environment (:func:`step_env`), which srun passes on
    (its default ``--export=ALL``): never on the command line, which every user of the node can read."""
    c = recipe.slurm.container
    if c is None or c.runtime != "pyxis":
        return []
    return [f"--container-image={c.image}", f"--container-mounts={','.join(mounts(c, run_dir))}",
            f"--container-workdir={workdir(c)}", f"--container-env={','.join(['PYTHONPATH', *c.env])}"]


def step_env(recipe: Recipe) -> dict[str, str]:
    """What a step's process (srun, or the local process that runs ``apptainer exec``) gets in its environment for
    ``slurm.container.env``: the variables themselves for pyxis (``--container-env`` names them), Apptainer's
    ``APPTAINERENV_<NAME>`` for Apptainer (which sets ``NAME`` inside, over the image's value). Values may be
    secrets (a token): a process's environment is its owner's to read, its command line anyone's."""
    c = recipe.slurm.container
    if c is None or c.runtime is None:
        return {}
    if c.runtime == "apptainer":
        return {f"APPTAINERENV_{k}": v for k, v in c.env.items()}
    return dict(c.env)


def command(recipe: Recipe, run_dir: Path, argv: list[str], pythonpath: str | None = None) -> list[str]:
    """A step's own command ``argv`` (``[python, -m, module, ...]``) as it runs in the container: the image's
    Python instead of the host's, behind ``apptainer exec`` for Apptainer (``--env PYTHONPATH`` wins over the
    image's value; ``env``'s variables come by :func:`step_env`, off the command line). ``pythonpath``: the step's
    (default :func:`step_pythonpath`)."""
    c = recipe.slurm.container
    if c is None:
        return list(argv)
    inner = [c.python, *argv[1:]]
    if c.runtime != "apptainer":
        return inner
    return [APPTAINER, "exec", "--nv", "--bind", ",".join(mounts(c, run_dir)),
            "--env", f"PYTHONPATH={pythonpath or step_pythonpath()}", "--pwd", workdir(c), c.image, *inner]


def unserved(recipe: Recipe, runtimes: tuple[str, ...], here: bool = False) -> str | None:
    """Why the recipe's container cannot run where only ``runtimes`` can (None when it can, or has none);
    ``here``: the steps start on this machine, so its runner must be on this PATH."""
    c = recipe.slurm.container
    if c is None or c.runtime is None:
        return None
    if c.runtime not in runtimes:
        return (f"{c.runtime} cannot start the steps here: pyxis runs a container only through srun, and this run "
                "starts its steps as processes of this machine (relax-submit --local, or no sbatch here). Fix: submit "
                f"to Slurm, or use runtime: {' or '.join(runtimes) or 'none'}, or set slurm.container: null")
    if here and c.runtime == "apptainer" and shutil.which(APPTAINER) is None:
        return ("the steps start on this machine and there is no apptainer on PATH. Fix: install Apptainer or load "
                "its module, or set slurm.container: null for a local run")
    return None


def readable(line: str) -> str:
    """A step's shell-quoted command line with each container part on a line of its own (``--dry-run``); a line
    without a container comes back as it is."""
    words = shlex.split(line)
    cuts: list[int] = []
    if APPTAINER in words and words[words.index(APPTAINER) + 1:][:1] == ["exec"]:
        i = words.index(APPTAINER)
        cuts.append(i)
        i += 2
        while i < len(words) and words[i].startswith("-"):
            if words[i] in _APPTAINER_VALUED and words[i - 2:i - 1] != [words[i]]:  # a run of --env on one line
                cuts.append(i)
            i += 2 if words[i] in _APPTAINER_VALUED else 1
        cuts.append(i + 1)  # the command, after the image
    elif any(w.startswith("--container-image=") for w in words):
        cuts = [i for i, w in enumerate(words) if w.startswith(("--container-", "--export="))]
        cuts += [cuts[-1] + 1,  # slurm.srun_args, then the command
                 next((i for i in range(cuts[-1], len(words)) if not words[i].startswith("-")), len(words))]
    else:
        return line
    bounds = [0, *cuts, len(words)]
    return " \\\n    ".join(shlex.join(words[a:b]) for a, b in zip(bounds, bounds[1:]) if a < b)
