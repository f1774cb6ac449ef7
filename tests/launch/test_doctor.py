"""relax-doctor: the checks of this machine, each failure with its fix; the SGLang range against stand-in
environments (a real interpreter whose metadata says the release); relax-submit's preflight part; and one run as
a Slurm job on two nodes of the dev cluster, with a check failing on purpose."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from relax_hpc.launch import doctor
from relax_hpc.launch.doctor import FAIL, OK, SKIP, WARN
from relax_hpc.launch.preflight import preflight_problems
from relax_hpc.recipe import recipe_from_dict

REPO = Path(__file__).resolve().parents[2]


def by_name(checks):
    return {c.name: c for c in checks}


def test_this_machine(tmp_path):
    """Every check runs here; what this machine has passes, what it lacks (CUDA on CI) is skipped, not failed."""
    import torch

    probe = doctor.write_probe(tmp_path)
    checks = by_name(doctor.local_checks(probe))
    assert list(checks) == ["python", "torch", "cuda", "nccl", "transformer_engine", "sglang", "ports", "network",
                            "run dir"]
    assert checks["python"].status == OK and checks["torch"].status == OK
    assert checks["torch"].detail.startswith(torch.__version__)
    gpu = torch.cuda.is_available()
    assert checks["cuda"].status == (OK if gpu else SKIP) and checks["nccl"].status == (OK if gpu else SKIP)
    assert checks["ports"].status == OK
    assert checks["run dir"].status == OK and f"inode {os.stat(probe['path']).st_ino}" in checks["run dir"].detail
    assert all(c.fix == "" for c in checks.values() if c.status in (OK, SKIP))


def test_run_dir_not_shared_fails_with_its_fix(tmp_path):
    """A node that does not see the submitter's probe, or sees another file at its path (a node-local /scratch of
    the same name), fails naming the directory and the fix."""
    (tmp_path / "shared").mkdir()
    probe = doctor.write_probe(tmp_path / "shared")
    gone = doctor.look_at_probe(str(tmp_path / "elsewhere" / Path(probe["path"]).name), probe["token"])
    c = doctor.check_filesystem(probe, gone)
    assert c.status == FAIL and "not there" in c.detail and "run.runs_root" in c.fix
    other = tmp_path / "other"
    other.write_text("someone else's")
    c = doctor.check_filesystem(probe, doctor.look_at_probe(str(other), probe["token"]))
    assert c.status == FAIL and "another file" in c.detail and str(probe["ino"]) in c.detail
    assert doctor.check_filesystem(probe, doctor.look_at_probe(probe["path"], probe["token"])).status == OK


def test_nccl_interfaces():
    ifaces = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"], "eth1": ["10.1.0.2"], "ib0": ["10.2.0.2"],
              "docker0": ["172.17.0.1"]}
    assert doctor.nccl_interfaces(None, ifaces) == ["eth0", "eth1", "ib0"]  # NCCL's default: not lo*, docker*
    assert doctor.nccl_interfaces("eth", ifaces) == ["eth0", "eth1"]  # prefixes
    assert doctor.nccl_interfaces("=eth1,ib0", ifaces) == ["eth1", "ib0"]  # exact names
    assert doctor.nccl_interfaces("=eth", ifaces) == []
    assert doctor.nccl_interfaces("^eth,lo,docker", ifaces) == ["ib0"]  # exclusions
    c = doctor.check_interfaces("nosuchif")  # this machine's interfaces
    assert c.status == FAIL and "NCCL_SOCKET_IFNAME=nosuchif" in c.detail and "up here:" in c.fix


def sglang_env(root: Path, version: str | None) -> str:
    """An interpreter whose environment has SGLang ``version`` installed (its metadata; the doctor reads no more)."""
    site = root / f"site-{version}"
    if version:
        info = site / f"sglang-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    py = root / f"python-{version}"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    return str(py)


def test_sglang_range(tmp_path):
    """The releases relax_hpc's client speaks (0.5.15+): older fails, newer than the one it follows warns."""
    got = {v: doctor.check_sglang(sglang_env(tmp_path, v)) for v in ("0.5.10", "0.5.20", "0.5.23", "0.6.1", None)}
    assert got["0.5.10"].status == FAIL and "older than 0.5.15" in got["0.5.10"].detail
    assert "tools/install --gpu --sglang DIR" in got["0.5.10"].fix
    assert (got["0.5.20"].status, got["0.5.23"].status) == (OK, OK)
    assert "plain" in got["0.5.20"].detail and "session" in got["0.5.23"].detail
    assert got["0.6.1"].status == WARN
    assert got[None].status == FAIL and "has no sglang" in got[None].detail
    plain = tmp_path / "not-exec"
    plain.write_text("")
    assert "not executable" in doctor.check_sglang(str(plain)).detail
    assert doctor.check_sglang("").status == SKIP


def sglang_recipe(kind: str, python: str | None = None):
    env = {"RELAX_SGLANG_PYTHON": python} if python else {}
    return recipe_from_dict({"rollout": {"engine": {"kind": kind}}, "slurm": {"env": env}})


def test_submit_preflight(tmp_path, monkeypatch):
    """relax-submit's preflight refuses an SGLang interpreter that cannot run, or whose release is out of range
    when the recipe asks for SGLang, naming the key; what may be fine on the compute nodes passes."""
    monkeypatch.delenv("RELAX_SGLANG_PYTHON", raising=False)
    old, good = sglang_env(tmp_path, "0.5.10"), sglang_env(tmp_path, "0.5.23")
    sg = lambda r, ex="local": [p for p in preflight_problems(r, ex) if "SGLANG" in p[2] or "SGLang" in p[2]]  # noqa: E731
    (key, value, msg), = sg(sglang_recipe("sglang", old))
    assert (key, value) == ("rollout.engine.kind", "sglang") and "0.5.10" in msg and "Fix:" in msg
    assert sg(sglang_recipe("sglang", good)) == []
    assert doctor.submit_problems(sglang_recipe("auto", old), "local") == []  # auto: the release is not asked for
    plain = tmp_path / "plain"
    plain.write_text("")
    (key, value, msg), = doctor.submit_problems(sglang_recipe("auto", str(plain)), "slurm")
    assert (key, value) == ("slurm.env.RELAX_SGLANG_PYTHON", str(plain)) and "not executable" in msg
    missing = str(tmp_path / "nosuch" / "python")
    assert doctor.submit_problems(sglang_recipe("sglang", missing), "slurm") == []  # may exist on the nodes
    assert "no such file" in doctor.submit_problems(sglang_recipe("sglang", missing), "local")[0][2]
    monkeypatch.setenv("RELAX_SGLANG_PYTHON", str(plain))  # from the environment: named so
    assert doctor.submit_problems(sglang_recipe("auto"), "local")[0][0] == "$RELAX_SGLANG_PYTHON (environment)"
    assert doctor.submit_problems(sglang_recipe("reference"), "local") == []
    monkeypatch.delenv("RELAX_SGLANG_PYTHON")
    assert doctor.submit_problems(sglang_recipe("sglang"), "slurm") == []  # unset here: the steps may set it


def test_main_exit_code_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuchif")
    assert doctor.main(["--json", "--run-dir", str(tmp_path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and [c["name"] for c in out["checks"] if c["status"] == FAIL] == ["network"]
    assert list(tmp_path.iterdir()) == []  # the probe is removed


def test_a_run_dir_that_does_not_exist_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    """A typo in --run-dir must not make the directory (and then pass the check on it): exit 2, the path named."""
    typo = tmp_path / "rnus"
    assert doctor.main(["--json", "--run-dir", str(typo)]) == 2
    err = capsys.readouterr().err
    assert f"--run-dir {typo} does not exist" in err and "run.runs_root" in err
    assert not typo.exists()
    (tmp_path / "file").write_text("x")
    assert doctor.main(["--run-dir", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # left out: the default runs root, made as relax-submit would
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuchif")
    assert doctor.main(["--json"]) == 1 and (tmp_path / "runs").is_dir()



def test_the_cuda_line_gives_the_memory_plans_card_size():
    """The cards' total bytes as torch reports them (an H100 80GB: 85,520,809,984) become the recipe line for
    slurm.gpu_memory_gb, in GiB rounded down, the smallest card's (a plan that fits it fits every card); a GPU
    node's cuda check ends with it."""
    import torch

    assert doctor.gpu_memory_key([85_520_809_984] * 8) == "recipe: slurm.gpu_memory_gb: 79.6"
    assert doctor.gpu_memory_key([85_520_809_984, 25_769_803_776]) == "recipe: slurm.gpu_memory_gb: 24"
    assert "unknown" in doctor.gpu_memory_key([])
    if torch.cuda.is_available():
        assert "slurm.gpu_memory_gb: " in doctor.check_cuda().detail

@pytest.mark.slurm
def test_two_nodes_on_the_dev_cluster(slurm_cluster, tmp_path, capsys):
    """One task per node (srun); every node sees the run directory's probe as the same file; a bad
    NCCL_SOCKET_IFNAME fails on both nodes with its fix, and the doctor exits 1. The table lists both nodes."""
    env = {**slurm_cluster.env, "NCCL_SOCKET_IFNAME": "nosuchif", "COLUMNS": "200"}
    env.pop("RELAX_SGLANG_PYTHON", None)
    (tmp_path / "runs").mkdir()
    argv = [sys.executable, "-m", "relax_hpc.launch.doctor", "--nodes", "2", "--gpus-per-node", "0",
            "--run-dir", str(tmp_path / "runs")]
    p = subprocess.run(argv + ["--json"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    checks = json.loads(p.stdout)["checks"]
    [het] = [c for c in checks if c["name"] == "het jobs"]  # asked from the submitting node: slurm.layout auto
    assert het["status"] == OK and "takes heterogeneous jobs" in het["detail"], het
    checks = [c for c in checks if c["name"] != "het jobs"]
    nodes = {c["node"] for c in checks}
    assert len(nodes) == 2
    fs = [c for c in checks if c["name"] == "run dir"]
    assert [c["status"] for c in fs] == [OK, OK] and len({c["detail"] for c in fs}) == 1  # one inode
    net = [c for c in checks if c["name"] == "network"]
    assert [c["status"] for c in net] == [FAIL, FAIL] and all("NCCL_SOCKET_IFNAME" in c["fix"] for c in net)
    assert {c["name"] for c in checks if c["status"] == FAIL} == {"network"}
    assert list((tmp_path / "runs").iterdir()) == []
    console = Console(width=200, record=True)
    console.print(doctor.render([doctor.Check(**c) for c in checks]))  # what the command prints without --json
    table = console.export_text()
    assert re.search(rf"network\s*│\s*{','.join(sorted(nodes))}\s*│\s*fail\s*│", table), table
    assert doctor.main(["--nodes", "99", "--run-dir", str(tmp_path / "runs")]) == 2  # refused, not queued for ever
    assert "the partition has" in capsys.readouterr().err
