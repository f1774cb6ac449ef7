"""submitit executors for relax_hpc: one heterogeneous Slurm job per run, or the same run as local processes.

Why extend submitit rather than call sbatch ourselves: submitit already pickles the callable, gives job handles
(``job.state``, ``job.result()``, ``job.cancel()``), runs the callable with its signal protocol (USR2 →
``checkpoint()`` → ``scontrol requeue``) and, locally, restarts a job that asks to be requeued. What it cannot do
is a heterogeneous job (submitit issue #1741): its sbatch file has one resource block, and its sacct watcher
cannot read het rows (``123+0``, ``123+1``), so a het job's state stays UNKNOWN. :class:`HetSlurmExecutor`
keeps submitit's machinery and swaps exactly those two parts: the submission file is our rendered hetjob
template, and :class:`HetSlurmInfoWatcher` folds component rows into one state.

What runs is always :class:`ControllerTask`, i.e. ``relax_hpc.controller.run_controller(run_dir)``: in the
batch script (``exec``-ed, so it is the batch shell and gets ``--signal=B:USR2``), or in a local child process.
It hands the controller the launcher's ways back for a requeued attempt (``scontrol requeue``, a continuation
job): the controller never imports launch.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from submitit.core import utils as submitit_utils
from submitit.local.local import LocalExecutor, LocalJob
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from relax_hpc.launch.slurm import aggregate_state, scontrol_requeue


class ControllerTask:
    """The callable submitit pickles: ``run_controller(run_dir)``.

    It is checkpointable in submitit's sense: if submitit's own USR2 handler is the one that fires (the
    controller did not install its own), the job is requeued and this same task runs again; the controller
    then resumes from the run directory's ``latest`` checkpoint. The controller is imported when the task
    runs, not when it is pickled, so submitting never imports training code.

    ``resubmit`` (``launch.jobs.resubmit`` for Slurm runs, pickled by reference) submits a continuation job
    when Slurm refuses to requeue; with ``scontrol requeue`` it is how the controller comes back
    (:mod:`relax_hpc.controller.requeue`)."""

    resubmit: Callable[[Path], dict] | None = None  # also for a task pickled before this attribute existed

    def __init__(self, run_dir: str | Path, resubmit: Callable[[Path], dict] | None = None):
        self.run_dir = str(run_dir)
        self.resubmit = resubmit

    def __call__(self) -> Any:
        from relax_hpc.controller import recipe_copy, run_controller
        from relax_hpc.launch import attach
        from relax_hpc.rundir import RunDir

        # slurm.env's values: from the run's secrets file, not from the batch script (RUN/secrets.json)
        os.environ.update(recipe_copy.job_env(RunDir(Path(self.run_dir))))
        return run_controller(self.run_dir, requeue_job=scontrol_requeue, resubmit=self.resubmit, capacity=attach)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit_utils.DelayedSubmission:
        return submitit_utils.DelayedSubmission(ControllerTask(self.run_dir, self.resubmit))

    def __repr__(self) -> str:
        return f"ControllerTask({self.run_dir!r})"


def runner_argv(python: str, folder: str | Path) -> list[str]:
    """The command that runs a pickled submitit job (the batch script's last line)."""
    return [python, "-u", "-m", "submitit.core._submit", str(folder)]


# ------------------------------------------------------------------------------------------ Slurm ---

class HetSlurmInfoWatcher(SlurmInfoWatcher):
    """submitit's sacct watcher, taught het job ids: rows ``J+K`` become one entry ``J`` whose State is the
    aggregate (:func:`relax_hpc.launch.slurm.aggregate_state`); each ``J+K`` stays readable too."""

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        if not isinstance(string, str):
            string = string.decode()
        lines = string.splitlines()
        if len(lines) < 2:
            return {}
        names = lines[0].split("|")
        plain, het = [lines[0]], {}
        for line in lines[1:]:
            stats = {k: v.strip() for k, v in zip(names, line.split("|"))}
            jid = stats.get("JobID", "")
            if "+" in jid:
                if "." in jid:  # a step (123+0.batch, 123+1.0): not the job's state
                    continue
                main, offset = jid.split("+", 1)
                het.setdefault(main, {})[int(offset)] = stats
            else:
                plain.append(line)
        info = super().read_info("\n".join(plain)) if len(plain) > 1 else {}
        for main, comps in het.items():
            ordered = [comps[k] for k in sorted(comps)]
            for k, stats in comps.items():
                info[f"{main}+{k}"] = stats
            info[main] = {
                "JobID": main,
                "State": aggregate_state([c.get("State", "UNKNOWN") for c in ordered]),
                "NodeList": ",".join(c.get("NodeList", "") for c in ordered if c.get("NodeList")),
                "HetComponents": str(len(ordered)),
            }
        return info

    # sacct is eventually consistent: for a few seconds after a short het job ends it may show one plain row
    # ``J`` in a final state. submitit caches final states and stops asking, so without this a het job could
    # stay "COMPLETED" with only its first component seen. A job submitted as het is done only once its het
    # rows are read, or after a grace period (a dbd that never splits it must not hang ``result()``).
    HET_ROWS_GRACE_S = 180.0

    def __init__(self, delay_s: int = 60) -> None:
        super().__init__(delay_s=delay_s)
        self._het_pending: dict[str, float | None] = {}  # job id -> when first seen final as a plain row

    def expect_het(self, job_id: str) -> None:
        self._het_pending[job_id] = None

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        done = super().is_done(job_id, mode=mode)
        if job_id not in self._het_pending:
            return done
        if not done:
            return False
        if "HetComponents" not in self._info_dict.get(job_id, {}):
            first_final = self._het_pending[job_id] = self._het_pending[job_id] or time.monotonic()
            if time.monotonic() - first_final < self.HET_ROWS_GRACE_S:
                return False
        del self._het_pending[job_id]
        return True


class HetSlurmJob(SlurmJob):
    watcher = HetSlurmInfoWatcher(delay_s=600)


class HetSlurmExecutor(SlurmExecutor):
    """A SlurmExecutor whose submission file is a rendered hetjob script.

    ``render(argv)`` returns the script whose body ``exec``s ``argv`` (the submitit runner); the resource
    blocks come from the recipe, not from ``update_parameters``. One task per job: only the batch script runs
    the pickled callable (the controller); the role steps are started by the controller with ``srun``."""

    job_class = HetSlurmJob

    def __init__(self, folder: str | Path, render: Callable[[list[str]], str], timeout_min: float,
                 max_num_timeout: int = 3, python: str | None = None):
        self.raw_python = python or sys.executable
        super().__init__(folder, max_num_timeout=max_num_timeout, python=shlex.quote(self.raw_python))
        self._render = render
        self.parameters["time"] = timeout_min  # read by submitit for the task's timeout bookkeeping

    def runner_argv(self) -> list[str]:
        return runner_argv(self.raw_python, self.folder)

    @property
    def _submitit_command_str(self) -> str:
        return shlex.join(self.runner_argv())

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        if command != self._submitit_command_str:  # only our runner may be submitted this way
            raise ValueError(f"HetSlurmExecutor submits the submitit runner only, not {command!r}")
        text = self._render(self.runner_argv())
        self._submitted_het = "#SBATCH hetjob" in text
        return text

    def _num_tasks(self) -> int:
        return 1

    def _internal_process_submissions(self, delayed_submissions: list) -> list:
        if len(delayed_submissions) != 1:
            raise ValueError("a relax_hpc run is one heterogeneous job: submit one task at a time")
        jobs = super()._internal_process_submissions(delayed_submissions)
        if getattr(self, "_submitted_het", False):
            for job in jobs:
                job.watcher.expect_het(job.job_id)
        return jobs


# ------------------------------------------------------------------------------------------ local ---

class RelaxLocalExecutor(LocalExecutor):
    """submitit's LocalExecutor, with the child in its own session and its output in a log file.

    Its own session (process group = its PID) so that ``relax-cancel`` can signal the whole run (submitit's
    local controller, the task running the controller, and the role processes it starts) and so that closing
    the terminal of a ``--detach``ed run does not kill it. Extra environment (``RELAX_EXECUTOR=local``, the
    recipe's ``slurm.env``) is added here; ``CUDA_VISIBLE_DEVICES`` is left as it is (submitit would blank it)."""

    job_class = LocalJob

    def __init__(self, folder: str | Path, env: dict[str, str], log: Path, timeout_min: float,
                 signal_delay_s: int, max_num_timeout: int = 3, python: str | None = None):
        self.raw_python = python or sys.executable
        super().__init__(folder, max_num_timeout=max_num_timeout, python=shlex.quote(self.raw_python))
        self._extra_env = dict(env)
        self._log = Path(log)
        self.parameters.update(timeout_min=timeout_min, signal_delay_s=signal_delay_s, tasks_per_node=1)

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return {"timeout_min", "signal_delay_s", "tasks_per_node"}

    @property
    def _submitit_command_str(self) -> str:
        return shlex.join(runner_argv(self.raw_python, self.folder))

    def _submit_command(self, command: str) -> LocalJob:
        env = dict(os.environ)
        env.update(
            SUBMITIT_LOCAL_NTASKS="1",
            SUBMITIT_LOCAL_COMMAND=command,
            SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * self.parameters["timeout_min"])),
            SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(self.parameters["signal_delay_s"])),
            SUBMITIT_LOCAL_NODEID="0",
            SUBMITIT_LOCAL_JOB_NUM_NODES="1",
            SUBMITIT_STDERR_TO_STDOUT="",
            SUBMITIT_EXECUTOR="local",
            SUBMITIT_LOCAL_WITH_SHELL="",
        )
        env.update(self._extra_env)
        self._log.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log, "ab") as out:
            process = subprocess.Popen(  # noqa: S603 - an argument list, no shell
                [self.raw_python, "-m", "submitit.local._local", str(self.folder)],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=[0])


def read_result(folder: str | Path, job_id: str) -> tuple[str, Any] | None:
    """submitit's result pickle of a finished job: ('success', summary) or ('error', traceback); None if absent."""
    path = submitit_utils.JobPaths(folder, job_id=job_id, task_id=0).result_pickle
    if not path.exists():
        return None
    if not path.is_file():  # a FIFO there would hang the read
        return ("error", f"unreadable result {path}: not a regular file")
    try:
        return submitit_utils.pickle_load(path)
    except Exception as e:  # a truncated pickle, or one whose classes moved
        return ("error", f"unreadable result {path}: {e}")
