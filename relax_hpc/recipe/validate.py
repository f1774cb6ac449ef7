"""Turn a merged mapping into a :class:`Recipe`, collecting every problem instead of stopping at the first.

Two passes: ``build`` (:mod:`relax_hpc.recipe.build`) checks shape and types against the dataclasses (unknown keys
with a "did you mean"); ``check`` checks meaning (resources that fit together, strings safe for Slurm). Both report
(key, value, message) triples so the user sees the key, the value and the fix in one error.
Each section's own checks live beside its config (:mod:`relax_hpc.rollout.checks`, :mod:`relax_hpc.train.config`,
...): ``check`` calls them in a fixed order and keeps here only what spans sections (roles, strings, paths, env).
The checks that read files (data, the model's config, the user functions) are
:func:`relax_hpc.launch.files.check_files`, run by relax-submit, not by the roles.
"""

from __future__ import annotations

import re

from relax_hpc.algo.config import PLUGIN_CALLS, check as check_algorithm, check_opd
from relax_hpc.engines.config import check_engine_args
# the first pass, with the problem triple both passes report: load.py and the tests take them from here
from relax_hpc.recipe.build import Problem, build, schema_keys, unknown_key_hint  # noqa: F401
from relax_hpc.recipe.memory_plan import recipe_problems as check_memory_keys
from relax_hpc.recipe.schema import ROLE_NAMES, Recipe
from relax_hpc.rollout import checks as rollout_checks
from relax_hpc.train.config import (check as check_train, check_batch, check_lora_adapter_mode,
                                    check_lora_reference, check_overlap_sync,
                                    check_train_offload)
from relax_hpc.train.forward_config import check as check_forward


# Strings that become Slurm arguments: a conservative set Slurm itself accepts in names and lists.
# Always used with ``fullmatch``: ``$`` also matches before a trailing newline, so "debug\n" passed a ``^...$``
# check and was refused only later by the sbatch renderer, naming no key.
_SLURM_WORD = re.compile(r"[A-Za-z0-9_.:,+@%/=-]*")
_SLURM_OPTION = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.:,+@%/=-]*)?")
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}|\d+-\d+")
_MEM = re.compile(r"\d+[KMGT]?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SHELL_META = set(";&|<>`$()\\\"'*?[]{}~!#\n\r\t ")


def check(recipe: Recipe) -> list[Problem]:
    """Meaning checks that need several fields at once. Types are already right here."""
    problems: list[Problem] = []
    problems += _check_strings(recipe)
    problems += _check_path_lengths(recipe)
    problems += _check_roles(recipe)
    if recipe.run.steps < 1:
        problems.append(("run.steps", recipe.run.steps, "must be at least 1"))
    if recipe.max_staleness < 0:
        problems.append(("max_staleness", recipe.max_staleness, "must be 0 or more"))
    if recipe.slurm.signal_lead_s < 0:
        problems.append(("slurm.signal_lead_s", recipe.slurm.signal_lead_s, "must be 0 or more seconds"))
    for key, val, low in (("checkpoint.interval", recipe.checkpoint.interval, 0), ("checkpoint.keep", recipe.checkpoint.keep, 1),
                          ("checkpoint.max_restarts", recipe.checkpoint.max_restarts, 0),
                          ("slurm.max_requeues", recipe.slurm.max_requeues, 0),
                          ("health.max_role_restarts", recipe.health.max_role_restarts, 0)):
        if val < low:
            problems.append((key, val, f"must be at least {low}"))
    if recipe.health.window_s < 0:
        problems.append(("health.window_s", recipe.health.window_s, "must be 0 or more seconds (0: a role restarted "
                                                                    "alone may fail again at once and still restart alone)"))
    if recipe.logging.task_timeout_s < 0:
        problems.append(("logging.task_timeout_s", recipe.logging.task_timeout_s,
                         "must be 0 or more seconds (0 turns the hung-task check off)"))
    for key in ("reward_timeout_s", "request_timeout_s"):  # every wait on user code or an engine is bounded
        val = getattr(recipe.rollout, key, None)
        if val is not None and val <= 0:
            problems.append((f"rollout.{key}", val, "must be more than 0 seconds"))
    if recipe.logging.heartbeat_timeout_s <= recipe.logging.heartbeat_s:
        problems.append(("logging.heartbeat_timeout_s", recipe.logging.heartbeat_timeout_s,
                         f"must be longer than logging.heartbeat_s = {recipe.logging.heartbeat_s}"))
    if recipe.logging.notify_urls:
        from relax_hpc.ops.notify import Notifier

        for i, url in enumerate(recipe.logging.notify_urls):
            if Notifier.check([url]):  # the value shown is the scheme only: URLs carry tokens
                problems.append((f"logging.notify_urls[{i}]", url.split("://", 1)[0] + "://...",
                                 "is not a URL Apprise understands. Fix: see https://github.com/caronc/apprise/wiki"))
    if recipe.logging.wandb is not None:
        from relax_hpc.ops.wandb_log import check as check_wandb

        problems += check_wandb(recipe.logging.wandb)
    problems += [(f"algorithm.{k}", v, m) for k, v, m in check_algorithm(recipe.algorithm)]
    if recipe.opd is not None:
        problems += [(f"opd.{k}", v, m) for k, v, m in check_opd(recipe.opd)
                     if not (k == "teacher_url" and v is None)]  # which teacher the run asks: check_teacher
    problems += [(f"train.{k}", v, m) for k, v, m in check_train(recipe.train)]
    problems += check_forward(recipe)  # reference and actor_fwd: their layout, as train.* is the actor's
    problems += rollout_checks.check_data(recipe.data, recipe.rollout)  # keys already carry their section
    problems += rollout_checks.check_rm_type(recipe)
    problems += check_batch(recipe)
    problems += rollout_checks.check_dynamic_sampling(recipe.rollout, recipe.mode)
    problems += rollout_checks.check_streaming(recipe)
    problems += rollout_checks.check_context_bound(recipe)
    if recipe.rollout.interaction_env_path or not recipe.rollout.custom_config_path:  # else its YAML says: check_files
        problems += rollout_checks.check_lengths(recipe, bool(recipe.rollout.interaction_env_path))
    problems += rollout_checks.check_genrm(recipe)
    problems += rollout_checks.check_teacher(recipe)
    problems += check_engine_args(recipe)
    problems += check_train_offload(recipe)
    problems += check_overlap_sync(recipe)
    problems += _check_colocate_nodes(recipe)
    problems += check_lora_adapter_mode(recipe)
    problems += check_lora_reference(recipe)
    problems += check_memory_keys(recipe)  # slurm.gpu_memory_gb; megatron-core's optimizer offload: GPU only
    if recipe.train.routing_replay and recipe.roles.actor_fwd.enabled:
        problems.append(("train.routing_replay", True, "with roles.actor_fwd: its π_old pass has no engine experts "
                         "to replay, so π_old and π_θ would route differently. Fix: disable roles.actor_fwd (the "
                         "actor's own forward is π_old) or routing_replay"))
    problems += rollout_checks.check_elastic(recipe)
    problems += _check_container(recipe)
    return problems


_IMAGE = re.compile(r"[A-Za-z0-9_./][A-Za-z0-9_.:/@#+=-]*")  # enroot URIs (nvcr.io#nvidia/...), paths, docker://
_MOUNT_PATH = re.compile(r"/[A-Za-z0-9_./+@%=-]*")  # absolute; ',' and ':' separate mounts, the rest is shell syntax
_PYTHON = re.compile(r"[A-Za-z0-9_./+-]+")


def _bad_chars(val: str, allowed: re.Pattern) -> str:
    bad = sorted({c for c in val if not allowed.fullmatch("/" + c)})  # each pattern takes '/' first
    return f"contains {' '.join(repr(c) for c in bad)}, refused" if bad else "is not allowed here"


def _check_container(r: Recipe) -> list[Problem]:
    """``slurm.container`` (docs/containers.md): every value becomes an srun option or an ``apptainer exec``
    argument, so each is a plain word or an absolute path, and the options it sets are not set twice."""
    c = r.slurm.container
    if c is None:
        return []
    key = "slurm.container"
    out: list[Problem] = []
    if c.runtime is None:
        out.append((f"{key}.runtime", None, "says which runtime starts the image. Fix: runtime: pyxis (srun "
                                            "--container-image, on clusters with pyxis/enroot) or runtime: apptainer "
                                            "(apptainer exec --nv)"))
    example = ("an Apptainer image such as '/shared/images/relax.sif'" if c.runtime == "apptainer" else
               "an enroot image such as 'nvcr.io#nvidia/pytorch:25.09-py3' or '/shared/images/relax.sqsh'")
    if not c.image.strip():
        out.append((f"{key}.image", c.image, f"is empty: the steps need an image to run in. Fix: {example}"))
    elif not _IMAGE.fullmatch(c.image):
        out.append((f"{key}.image", c.image, f"{_bad_chars(c.image, _IMAGE)}: an image is a registry URI or a path "
                                             f"without spaces or shell syntax. Fix: {example}"))
    for i, m in enumerate(c.mounts):
        src, dst, *flags = [*m.split(":"), ""][:max(2, m.count(":") + 1)]
        if not (m.count(":") in (1, 2) and _MOUNT_PATH.fullmatch(src) and _MOUNT_PATH.fullmatch(dst)
                and flags in ([], ["ro"], ["rw"])):
            out.append((f"{key}.mounts[{i}]", m, "is not SRC:DST (two absolute paths without ',' ':' spaces or "
                                                 "shell syntax, then ':ro' or ':rw' if you like). Fix: e.g. "
                                                 "'/lustre/models:/lustre/models:ro'"))
    for k, v in c.env.items():
        name = f"{key}.env.{k}" if k.isprintable() else f"{key}.env[{k!r}]"
        if not _ENV_NAME.fullmatch(k):
            out.append((name, v, f"the variable name {k!r} must be letters, digits and '_'. Fix: rename it"))
        elif k == "PYTHONPATH" or launcher_env_var(k):
            out.append((name, v, f"{k} is set by relax_hpc for every step (PYTHONPATH puts this relax_hpc first; "
                                 "RELAX_*/SLURM_* say who a rank is). Fix: remove it from slurm.container.env"))
        elif c.runtime == "pyxis" and (k in _HOST_LOADER_ENV or k.startswith("LD_")):
            out.append((name, v, f"with pyxis, env's values are in the environment of the host's srun (pyxis takes "
                                 f"them from there), so {k} would change how the host runs srun itself. Fix: set it "
                                 "in the image (ENV in its Dockerfile), or use runtime: apptainer"))
        elif "\0" in v:  # values travel in the steps' environment (not on srun/apptainer lines): ',' is fine
            out.append((name, v, "contains a NUL byte, which no environment variable can hold. Fix: remove it"))
    if c.workdir is not None and not _MOUNT_PATH.fullmatch(c.workdir):
        out.append((f"{key}.workdir", c.workdir, f"{_bad_chars(c.workdir, _MOUNT_PATH)}: the working directory is "
                                                 "an absolute path without ',' ':' or shell syntax. Fix: e.g. "
                                                 "'/lustre/project', or remove it for the directory relax-submit "
                                                 "runs in"))
    if not _PYTHON.fullmatch(c.python):
        out.append((f"{key}.python", c.python, f"{_bad_chars(c.python, _PYTHON)}: the image's interpreter, a "
                                               "command or a path. Fix: e.g. 'python3' or '/usr/bin/python'"))
    if any(ch in r.run.runs_root for ch in ",:"):
        out.append(("run.runs_root", r.run.runs_root, "contains ',' or ':', which separate container mounts, and "
                                                      "the run directory is mounted into the container. Fix: a "
                                                      "directory path without them"))
    for i, opt in enumerate(r.slurm.srun_args):
        if opt.startswith("--container-") or (opt.startswith("--export") and c.env and c.runtime == "pyxis"):
            out.append((f"slurm.srun_args[{i}]", opt, "sets what slurm.container sets itself (the container "
                                                      "options, and --export for its env). Fix: remove it, and "
                                                      "say it in slurm.container"))
    return out


_HOST_LOADER_ENV = ("PATH", "PYTHONHOME", "PYTHONSTARTUP")  # with LD_*: what decides which binary a host process runs


def _check_colocate_nodes(r: Recipe) -> list[Problem]:
    """Colocate on several actor nodes: each node's engines get their weights on their own node from that node's first
    actor rank (relax_hpc.weights.push.plan_nodes), so the engines must be on every actor node, and weights handed
    over by tensor (CUDA IPC, shared memory) only reach engines on the actor's nodes. Refused here, before the
    allocation, instead of at the engines' first connect."""
    a, g, out = r.roles.actor, r.roles.rollout, []
    if a.nodes < 2:
        return out
    if r.mode == "colocate" and g.share_with == "actor" and g.nodes != a.nodes:
        out.append(("roles.rollout.nodes", g.nodes, f"colocate on {a.nodes} actor nodes puts engines on every actor node "
                    f"(each node's engines get their weights from that node's actor ranks), but rollout shares only "
                    f"{g.nodes} of them. Fix: roles.rollout.nodes: {a.nodes}"))
    if r.rollout.engine.offload and g.share_with != "actor":
        out.append(("rollout.engine.offload", True, f"hands the weights over on each node (CUDA IPC, shared memory) "
                    f"from that node's actor ranks, but the engines are not on the actor's {a.nodes} nodes "
                    "(roles.rollout.share_with is not actor). Fix: roles.rollout.share_with: actor with roles.rollout."
                    f"nodes: {a.nodes}, or rollout.engine.offload: false (a weight-sync group across nodes)"))
    return out


_PLACEMENT_OPTIONS = {"--het-group", "--relative", "-r", "--nodelist", "-w", "--exclude", "-x"}  # each step's own


def _check_strings(r: Recipe) -> list[Problem]:
    """Every string that becomes a Slurm argument must be a plain word: no value reaches a shell unquoted,
    and refusing metacharacters up front turns a confusing sbatch failure into a named key."""
    out = _check_line_breaks(r)
    broken = {k for k, _, _ in out}
    s = r.slurm
    words = {"slurm.partition": s.partition, "slurm.account": s.account, "slurm.qos": s.qos,
             "slurm.constraint": s.constraint, "slurm.job_name": s.job_name}
    for key, val in words.items():
        if key not in broken and val is not None and (not val or not _SLURM_WORD.fullmatch(val)):
            out.append((key, val, _meta_msg(val, "a Slurm name as `sinfo`/`sacctmgr` prints it")))
    if "slurm.time" not in broken and not _SLURM_TIME.fullmatch(s.time):
        out.append(("slurm.time", s.time, "is not Slurm time syntax. Fix: MM, HH:MM:SS or D-HH:MM:SS, e.g. '02:00:00'"))
    for i, opt in enumerate(s.sbatch_extra):
        if f"slurm.sbatch_extra[{i}]" not in broken and not _SLURM_OPTION.fullmatch(opt):
            out.append((f"slurm.sbatch_extra[{i}]", opt,
                        _meta_msg(opt, "one sbatch option per item, like '--mail-type=END'")))
    for i, opt in enumerate(s.srun_args):
        if f"slurm.srun_args[{i}]" not in broken and not _SLURM_OPTION.fullmatch(opt):
            out.append((f"slurm.srun_args[{i}]", opt,
                        _meta_msg(opt, "one srun option per item, like '--container-image=img.sqsh'")))
        elif opt.split("=")[0] in _PLACEMENT_OPTIONS:
            out.append((f"slurm.srun_args[{i}]", opt, "places the steps, which relax_hpc does itself per role "
                        "(--het-group, or --relative in slurm.layout single). Fix: remove it; give a role its "
                        "nodes with roles.<role>.nodes and slurm.constraint"))
    out += _check_env(s.env, broken)
    if r.run.name is not None and "run.name" not in broken and not _RUN_NAME.fullmatch(r.run.name):
        out.append(("run.name", r.run.name,
                    _meta_msg(r.run.name, "letters, digits, '.', '_' and '-', starting with a letter or digit")))
    if "run.runs_root" not in broken and any(c in r.run.runs_root for c in "%\\"):
        out.append(("run.runs_root", r.run.runs_root,
                    "contains '%' or '\\', which Slurm expands as a filename pattern (%j: job id, %t: task) in the "
                    "log paths of the run but not in the run directory itself, so logs would land elsewhere. "
                    "Fix: a plain directory path without '%' or '\\'"))
    for name in ROLE_NAMES:
        mem = r.role(name).mem
        if mem is not None and f"roles.{name}.mem" not in broken and not _MEM.fullmatch(mem):
            out.append((f"roles.{name}.mem", mem, "is not Slurm memory syntax. Fix: e.g. '16G' or '4000M'"))
    return out


def _script_strings(r: Recipe) -> dict[str, str | None]:
    """Every recipe string that ends up in the sbatch script, an srun command line or a path the job opens."""
    s = r.slurm
    out: dict[str, str | None] = {
        "slurm.partition": s.partition, "slurm.account": s.account, "slurm.qos": s.qos,
        "slurm.constraint": s.constraint, "slurm.job_name": s.job_name, "slurm.time": s.time,
        "slurm.template": s.template, "run.name": r.run.name, "run.runs_root": r.run.runs_root,
        "model.path": r.model.path, "data.path": r.data.path,
    }
    out.update({f"slurm.sbatch_extra[{i}]": v for i, v in enumerate(s.sbatch_extra)})
    out.update({f"slurm.srun_args[{i}]": v for i, v in enumerate(s.srun_args)})
    # slurm.env's values are not here: they travel in the steps' environment, never in the script (secrets)
    out.update({f"data.eval_prompt_data.{k}": v for k, v in r.data.eval_prompt_data.items()})
    out.update({f"roles.{n}.mem": r.role(n).mem for n in ROLE_NAMES})
    return out


def _path_values(r: Recipe) -> dict[str, str | None]:
    """Every recipe string that names a file, a directory or a module the run or relax-submit opens."""
    ro = r.rollout
    out = {"model.path": r.model.path, "genrm.model_path": r.genrm.model_path, "data.path": r.data.path,
           "opd.teacher_model_path": r.opd.teacher_model_path if r.opd is not None else None,
           "rollout.custom_config_path": ro.custom_config_path, "slurm.template": r.slurm.template,
           "run.runs_root": r.run.runs_root, "rollout.custom_rm_path": ro.custom_rm_path,
           "rollout.dynamic_sampling_filter_path": ro.dynamic_sampling_filter_path,
           "rollout.sample_filter_path": ro.sample_filter_path,
           "rollout.custom_generate_function_path": ro.custom_generate_function_path,
           "rollout.interaction_env_path": ro.interaction_env_path}
    out.update({f"data.eval_prompt_data.{k}": v for k, v in r.data.eval_prompt_data.items()})
    out.update({f"algorithm.{k}": getattr(r.algorithm, k) for k in PLUGIN_CALLS})
    return out


_PATH_MAX, _NAME_MAX = 4096, 255  # Linux's limits, in bytes: beyond them every open fails (ENAMETOOLONG)


def _check_path_lengths(r: Recipe) -> list[Problem]:
    """A path the system cannot even look up: refused here, by key, instead of an OSError from the first
    stat of it (every check of a file, and each role, would stumble on it)."""
    out: list[Problem] = []
    for key, val in _path_values(r).items():
        if val is None:
            continue
        size = len(val.encode("utf-8", "surrogatepass"))
        longest = max((len(p.encode("utf-8", "surrogatepass")) for p in re.split(r"[/.:]", val)), default=0)
        if size >= _PATH_MAX or longest > _NAME_MAX:
            out.append((key, val, f"is too long for a path ({size} bytes; a path may have {_PATH_MAX - 1}, each "
                                  f"name in it {_NAME_MAX}). Fix: the right path"))
    return out


def _check_line_breaks(r: Recipe) -> list[Problem]:
    """A line break or NUL in any of these would end an ``#SBATCH``/``export`` line; the renderer refuses it,
    but only as "<sbatch template>", so say here which key holds it (usually a YAML ``|`` block's newline)."""
    out: list[Problem] = []
    for key, val in _script_strings(r).items():
        if val is None or not any(c in val for c in "\n\r\0"):
            continue
        body = val.rstrip("\n\r\0")
        where = "contains" if any(c in body for c in "\n\r\0") else "ends in"
        out.append((key, val, f"{where} a newline or NUL byte, which cannot go into the sbatch script or a "
                              f"command line. Fix: {val.strip()!r} on one line (a YAML '|' block keeps its final "
                              "newline: use a plain or quoted string)"))
    return out


# Variables the launcher sets or reads in the controller and the role steps: a recipe that sets them would
# change what relax_hpc starts (SUBMITIT_LOCAL_NTASKS=2 starts two controllers on one run directory) or who
# a rank thinks it is. Slurm-set ones describe the job; the user sets Slurm's *input* variables (SLURM_CONF,
# SBATCH_*, SRUN_*) freely.
_LAUNCHER_ENV_PREFIXES = ("SUBMITIT_", "RELAX_", "SLURM_JOB", "SLURM_STEP", "SLURM_HET", "SLURM_ARRAY",
                          "SLURM_NTASKS", "SLURM_TASKS", "SLURM_SUBMIT", "SLURM_SRUN_COMM", "SLURM_TOPOLOGY",
                          "SLURMD_")
_LAUNCHER_ENV_NAMES = {"SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NPROCS", "SLURM_NNODES",
                       "SLURM_NODELIST", "SLURM_RESTART_COUNT", "SLURM_GTIDS", "SLURM_TASK_PID",
                       "SLURM_CLUSTER_NAME", "SLURM_CPUS_ON_NODE", "SLURM_LAUNCH_NODE_IPADDR", "SLURM_PRIO_PROCESS",
                       "SLURM_CPUS_PER_TASK", "SLURM_GPUS_ON_NODE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}
# RELAX_* settings documented for users (docs/engines.md, docs/controller.md): not the launcher's own.
USER_RELAX_ENV = ("RELAX_SGLANG_PYTHON", "RELAX_SGLANG_TP", "RELAX_NOTIFY_URLS")


def launcher_env_var(name: str) -> bool:
    """True for a variable the launcher or Slurm sets for the job, which ``slurm.env`` must not override."""
    if name in USER_RELAX_ENV:
        return False
    return name in _LAUNCHER_ENV_NAMES or name.startswith(_LAUNCHER_ENV_PREFIXES)


def _check_env(env: dict[str, str], broken: set[str]) -> list[Problem]:
    out: list[Problem] = []
    for k, v in env.items():
        key = f"slurm.env.{k}" if k.isprintable() else f"slurm.env[{k!r}]"  # a newline in a key would split the line
        if not _ENV_NAME.fullmatch(k):
            out.append((key, v, f"the variable name {k!r} must be letters, digits and '_'. Fix: rename it"))
        elif launcher_env_var(k):
            out.append((key, v, f"{k} is set or read by relax_hpc's launcher or by Slurm for the job itself "
                                f"(SUBMITIT_*, RELAX_* except {', '.join(USER_RELAX_ENV)}, and Slurm's job/step "
                                "variables such as SLURM_JOB_ID, SLURM_PROCID, SLURM_NTASKS, SLURM_HET_*, "
                                "SLURM_RESTART_COUNT); overriding it breaks the run. Fix: remove it from slurm.env "
                                "and size the job with roles.<role>.nodes/tasks_per_node"))
        elif isinstance(v, str) and "\0" in v:  # the value travels in the environment, where a NUL cannot
            out.append((key, v, "contains a NUL byte, which no environment variable can hold. Fix: remove it"))
    return out


def _meta_msg(val: str, want: str) -> str:
    bad = sorted({c for c in val if c in _SHELL_META})
    shown = " ".join(repr(c) for c in bad)
    lead = f"contains shell metacharacters ({shown}) and was refused" if bad else "is not allowed here"
    return f"{lead}. Fix: use {want}."


def _check_roles(r: Recipe) -> list[Problem]:
    out: list[Problem] = []
    if not r.roles.actor.enabled:
        out.append(("roles.actor.enabled", False, "the actor is what learns; it cannot be disabled"))
    for name in ROLE_NAMES:
        g = r.role(name)
        key = f"roles.{name}"
        for attr, low in (("nodes", 1), ("tasks_per_node", 1), ("cpus_per_task", 1), ("gpus_per_node", 0)):
            if getattr(g, attr) < low:
                out.append((f"{key}.{attr}", getattr(g, attr), f"must be at least {low}"))
        if g.share_with is not None:
            host = g.share_with
            if host not in ROLE_NAMES or host == name:
                others = [n for n in ROLE_NAMES if n != name]
                out.append((f"{key}.share_with", host, f"must name another role: one of {', '.join(others)}"))
            elif not r.role(host).enabled:
                out.append((f"{key}.share_with", host, f"roles.{host} is disabled; enable it or give {name} its own nodes"))
            elif r.role(host).share_with is not None:
                out.append((f"{key}.share_with", host,
                            f"roles.{host} itself shares roles.{r.role(host).share_with}'s nodes; share with that role"))
            elif g.nodes > r.role(host).nodes:
                out.append((f"{key}.nodes", g.nodes,
                            f"a role sharing roles.{host} can use at most its {r.role(host).nodes} node(s)"))
    a = r.roles.actor
    world = a.nodes * a.tasks_per_node
    mp = r.train.tp * r.train.pp
    if mp > 0 and world % mp:
        out.append(("train.tp", r.train.tp,
                    f"train.tp × train.pp = {mp} does not divide the actor's {world} ranks "
                    f"(roles.actor.nodes × tasks_per_node). Fix: change tp/pp or the actor's size"))
    elif mp > 0 and (world // mp) % max(1, r.train.ep):  # Megatron splits the experts over data-parallel ranks
        out.append(("train.ep", r.train.ep, f"does not divide the actor's data-parallel size {world // mp} ({world} ranks "
                    f"÷ (train.tp × train.pp)). Fix: a divisor of {world // mp}, or change the actor's size"))
    if a.gpus_per_node and a.tasks_per_node != a.gpus_per_node:
        out.append(("roles.actor.tasks_per_node", a.tasks_per_node,
                    f"on GPU nodes the actor runs one rank per GPU: set it to gpus_per_node = {a.gpus_per_node}"))
    if r.algorithm.use_kl_loss and not r.roles.reference.enabled and r.train.lora is None:  # with LoRA: the actor's
        out.append(("algorithm.use_kl_loss", True, "needs the reference's log-probs (π_ref). Fix: "  # base (lora.py)
                    "roles.reference.enabled: true (share_with: actor puts it on the actor's nodes), or "
                    "algorithm.use_kl_loss: false"))
    if r.mode == "colocate" and r.max_staleness != 0:
        out.append(("max_staleness", r.max_staleness, "colocate mode is strictly on-policy: use 0, or mode: fully_async"))
    if r.staleness_mode == "fixed" and r.rollout.partial_rollout:
        out.append(("staleness_mode", "fixed", "cannot be reproducible with rollout.partial_rollout (which groups are "
                    "cut off depends on timing). Fix: staleness_mode: bounded, or rollout.partial_rollout: false"))
    return out

