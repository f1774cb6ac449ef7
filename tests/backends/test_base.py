"""The one interface of a place (relax_hpc.backends.base, chosen by relax_hpc.backends.backend_for): each backend
one class with both halves, picked once by name; and the checks that keep the executor names and the names
instead of backends out of the code."""

import re
from pathlib import Path

import pytest

import relax_hpc
from relax_hpc.backends import BACKENDS, Backend, LocalBackend, SlurmBackend, backend_for, backend_from_env
from relax_hpc.launch.tools import TOOLS, launcher_for

ROOT = Path(relax_hpc.__file__).resolve().parent
IN_JOB = {"control_host", "nodelist", "role_procs", "rendezvous", "engine_step_argv", "spare_engines",
          "spares_apart", "come_back"}
SUBMIT = {"job_label", "ended_cleanly", "component_label", "cancel", "place_problems", "job_state", "submit",
          "resume"}


def _lines(pattern: re.Pattern) -> list[str]:
    return sorted(f"{p.relative_to(ROOT)}:{i}" for p in ROOT.rglob("*.py")
                  for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line))


def test_no_branch_on_an_executor_s_name_outside_the_backends():
    found = _lines(re.compile(r"""[!=]=\s*["'](slurm|local)["']"""))
    assert not found, f"ask the run's backend instead (a method or property of relax_hpc.backends.Backend): {found}"


def test_no_signature_takes_a_backend_or_its_name():
    found = _lines(re.compile(r"str \| Backend|Backend \| str"))
    assert not found, f"take a Backend (the caller gets one once, with backends.backend_for): {found}"


@pytest.mark.parametrize("env, want", [
    ({}, LocalBackend),
    ({"SLURM_JOB_ID": "5", "SLURM_HET_SIZE": "3"}, SlurmBackend),
    ({"SLURM_JOB_ID": "5"}, LocalBackend),  # a plain (non-het) allocation is not a relax_hpc batch script
    ({"SLURM_JOB_ID": "5", "SLURM_HET_SIZE": "3", "RELAX_EXECUTOR": "local"}, LocalBackend),
])
def test_the_backend_is_chosen_once_from_the_environment(env, want):
    b = backend_from_env(env)
    assert type(b) is want and b.name == {SlurmBackend: "slurm", LocalBackend: "local"}[want]
    assert type(backend_for(b.name)) is want


def test_a_name_is_looked_up_and_an_unknown_one_refused():
    assert type(backend_for(None)) is SlurmBackend  # a job.json from before the field existed
    assert type(launcher_for(None)) is SlurmBackend and type(launcher_for("local")) is LocalBackend
    for make in (backend_for, launcher_for):
        with pytest.raises(ValueError, match="unknown executor 'ray'; known: slurm, local"):
            make("ray")


def test_each_backend_is_one_class_that_answers_both_halves():
    assert IN_JOB | SUBMIT <= Backend.__abstractmethods__
    for cls in BACKENDS.values():
        assert cls.__bases__ == (Backend,) and not cls.__abstractmethods__, cls  # no diamond, nothing left out

    class InJobOnly(SlurmBackend):
        submit = Backend.submit  # the submit half left abstract

    with pytest.raises(TypeError, match="abstract"):
        InJobOnly()


def test_the_submit_half_works_through_the_launcher_s_tools_and_says_how_to_get_them(run):
    assert launcher_for("slurm").tools is TOOLS
    with pytest.raises(RuntimeError, match=r"made without the launcher's tools.*Fix: get the backend with "
                                           r"relax_hpc\.launch\.tools\.launcher_for\(executor\)"):
        backend_for("local").job_state(run, {}, {})
    assert backend_for("local").job_label({"pid": 3}) == "local process 3"  # what needs no tools still answers
