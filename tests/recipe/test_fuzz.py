"""The recipe checks under abuse (issue 28): a few hundred random mutations of recipes/quickstart.yaml through
``relax-submit --dry-run``, in-process, with and without ``--local``. Each must end in exit 0, or in a refusal
(exit 2) that names a key, or the file (and line) for text that gives no recipe, with no traceback, in bounded
time and memory.

Mutations: keys deleted, values of other types, huge, deep and aliased values (alias bombs, merge-key bombs,
recursive aliases), bytes that are not UTF-8, lone surrogates, inf and nan, YAML tags, paths to the wrong kind
of file (a FIFO, a device, a directory), broken text, and the same values as command-line overrides. Without
``--local`` the cluster's answer is fixed to the dev cluster's four nodes (what ``sinfo`` reports there), so
the test needs no Slurm; ``--dry-run`` submits nothing either way.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import resource
import shutil
import signal
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from relax_hpc.launch import slurm
from relax_hpc.launch.cli import submit_main

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
SEED = 28
MUTATIONS = 200
CASE_S = 10.0  # CPU seconds of one dry run (~20 ms; a walk over an alias bomb takes minutes): CPU time, not wall
#                time, so a loaded CI machine does not fail it
CASE_MB = 128  # memory one dry run may add at its peak (the alias bomb took 1 GB in 30 s)
HANG_S = 60  # wall seconds: SIGALRM turns a hang into a failure naming the case
CAP_BYTES = 2 << 30  # address space one dry run may add (RLIMIT_AS) before it fails with MemoryError
DEV_CLUSTER = [slurm.Node(f"node{i}", ("debug", "urgent"), 4, 4, 4000, "idle") for i in range(1, 5)]
LOAD_KEYS = ("<file>", "<yaml>", "<recipe>", "<override>", "defaults")


@dataclass
class Case:
    name: str
    text: bytes  # the recipe file
    overrides: list[str] = field(default_factory=list)
    recipe: str | None = None  # the recipe argument, when it is not the file written from ``text``
    key: str | None = None  # a refusal must name this key (or the file or line, for text that gives no recipe)


@dataclass
class Result:
    rc: int | str
    out: str
    err: str
    seconds: float  # CPU time of this process
    peak_mb: float


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A submit directory like the repository's: the quickstart's model (its config.json) and prompts, plus
    wrong things to point paths at. The cluster's answer is the dev cluster's."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "runs" / "models" / "tiny-llama"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"max_position_embeddings": 64, "vocab_size": 128}')
    (tmp_path / "recipes" / "data").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "data" / "arith.jsonl", tmp_path / "recipes" / "data" / "arith.jsonl")
    (tmp_path / "nomodel").mkdir()
    os.mkfifo(tmp_path / "fifo")
    monkeypatch.setattr(slurm, "have_sbatch", lambda: True)
    monkeypatch.setattr(slurm, "sinfo_nodes", lambda: list(DEV_CLUSTER))
    monkeypatch.setattr(slurm, "default_partition", lambda: "debug")
    tracing = tracemalloc.is_tracing()
    yield tmp_path
    if tracemalloc.is_tracing() and not tracing:  # started by PeakMemory where /proc/self/clear_refs is not ours
        tracemalloc.stop()


def dry_run(case: Case, workdir: Path, local: bool, as_json: bool = False) -> Result:
    """``relax-submit --dry-run [--local] [--json] RECIPE OVERRIDES...`` in this process, output captured."""
    recipe = workdir / "fuzz.yaml"
    recipe.write_bytes(case.text)
    arg = str(recipe) if case.recipe is None else case.recipe
    argv = ["--dry-run", *(["--local"] if local else []), *(["--json"] if as_json else []), arg, *case.overrides]
    out, err = io.StringIO(), io.StringIO()

    def hung(signum, frame):
        raise TimeoutError(f"relax-submit hung for {HANG_S} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    limits = resource.getrlimit(resource.RLIMIT_AS)
    cap = PeakMemory.status("VmSize") * 2**20 + CAP_BYTES  # a MemoryError, not the OOM killer, if a bomb goes off
    if limits[1] == resource.RLIM_INFINITY or cap < limits[1]:
        resource.setrlimit(resource.RLIMIT_AS, (int(cap), limits[1]))
    peak = PeakMemory()
    start = time.process_time()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc: int | str = submit_main(argv)
            except BaseException as e:  # noqa: BLE001 - a crash is what this test looks for
                rc = f"raised {type(e).__name__}: {str(e)[:300]}"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    seconds = time.process_time() - start
    return Result(rc, out.getvalue(), err.getvalue(), seconds, peak.mb())


class PeakMemory:
    """How much this process's memory grew at its peak since made: Linux's resident high-water mark, reset
    through /proc/self/clear_refs (cheap); else tracemalloc's peak of Python allocations (slows PyYAML 6x)."""

    def __init__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base, self.traced = self.status("VmRSS"), False
        except OSError:
            if not tracemalloc.is_tracing():
                tracemalloc.start()
            tracemalloc.reset_peak()
            self.base, self.traced = tracemalloc.get_traced_memory()[0] / 2**20, True

    @staticmethod
    def status(field: str) -> float:
        """A memory size of /proc/self/status in MB."""
        with open("/proc/self/status") as f:
            return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024

    def mb(self) -> float:
        if self.traced:
            return tracemalloc.get_traced_memory()[1] / 2**20 - self.base
        return self.status("VmHWM") - self.base


def named_keys(err: str) -> list[str]:
    """The keys a refusal lists, in order (``  - KEY = VALUE: message`` or ``  - KEY: message``)."""
    return re.findall(r"^  - (.+?)(?: = |: )", err, re.M)


def verdict(case: Case, res: Result, recipe_arg: str, as_json: bool = False) -> str | None:
    """What is wrong with the outcome of ``case``, or None."""
    if not isinstance(res.rc, int):
        return str(res.rc)
    if "Traceback" in res.out + res.err:
        return "a traceback in the output"
    if res.seconds > CASE_S:
        return f"took {res.seconds:.1f} s of CPU"
    if res.peak_mb > CASE_MB:
        return f"peak memory {res.peak_mb:.0f} MB"
    if res.rc not in (0, 2):
        return f"exit {res.rc}"
    if as_json:
        try:
            printed = json.loads(res.out)
        except ValueError:
            return "--json printed no JSON"
        if res.rc == 2 and [p["key"] for p in printed["problems"]][:1] != named_keys(res.err)[:1]:
            return "--json names another key than the text"
    if res.rc == 0:
        return f"accepted, but {case.key} had to be refused" if case.key else None
    keys = named_keys(res.err)
    if not keys or f"recipe {Path(recipe_arg)} is invalid" not in res.err:
        return "refused without naming a key and the recipe"
    if keys[0] == "<yaml>" and not re.search(r"line \d+, column \d+", res.err):
        return "a YAML error without its line"
    if case.key and not any(k in LOAD_KEYS or k == case.key or k.startswith(case.key + ".")
                            or k.startswith(case.key + "[") or case.key.startswith(k + ".") for k in keys):
        return f"{case.key} not named"
    return None


# -------------------------------------------------------------------------------------------- mutations ---

SLOT = "fuzz_slot_value"

SWAPS = ["[]", "{}", "x", "0", "-1", "1.5", "true", "null", "[1, 2]", "{a: 1}", "''", "'1e-5'", "-7.25", "1e999",
         "'a b'", "[x, [y]]", "{nodes: 2}", "1000000000", "yes"]
TAGS = ["!!binary aGVsbG8=", "!!timestamp 2024-13-01", "2024-13-01", "2024-01-02", "!!python/name:os.system",
        "!!python/object/apply:os.getcwd []", "!!set {a, b}", '!!int "x"', '!!float "y"', "!!omap [a: 1]",
        "!!str 5", "!custom x", "0x7fffffffffffffffff", "1" + "0" * 5000, "0x" + "f" * 2000, "1" + "0" * 30]
NONFINITE = [".inf", "-.inf", ".nan", ".NaN", "1.0e+999", "-1.0e+999"]  # YAML 1.1 floats: 1.0e999 is a string
SURROGATES = ['"\\ud800"', '"a\\udcff"', '"\\udfff/model"']


def deep_list(n: int) -> str:
    return "[" * n + "]" * n


def deep_map(n: int) -> str:
    return "{a: " * n + "1" + "}" * n


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The billion laughs: about 1 KB that expands to width**levels values."""
    items = [f"&a0 [{', '.join(['lol'] * width)}]"]
    items += [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def merge_bomb(levels: int = 12) -> str:
    """Merge keys copy the pairs they merge: each level doubles them."""
    items = ["&m0 {a: 1, b: 2}"] + [f"&m{i} {{<<: [*m{i - 1}, *m{i - 1}], k{i}: {i}}}" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def wrong_paths(rng: random.Random, workdir: Path) -> str:
    return rng.choice([str(workdir / "fifo"), "/dev/null", "/dev/zero", "/", str(workdir), "/nonexistent/x",
                       str(workdir / "nomodel"), str(workdir / "recipes" / "data" / "arith.jsonl"),
                       "'" + "a" * 5000 + "'", '"a\\0b"', str(workdir / "fuzz.yaml"), "''",
                       str(workdir / "runs" / "models" / "tiny-llama" / "config.json")])


PATH_KEYS = ["model.path", "data.path", "rollout.custom_config_path", "slurm.template", "run.runs_root",
             "genrm.model_path", "data.eval_prompt_data.aime", "rollout.custom_rm_path",
             "algorithm.custom_loss_path"]


def key_paths(data, prefix: tuple = ()) -> list[tuple]:
    """Every key path in ``data`` (sections and leaves)."""
    out = []
    if isinstance(data, dict):
        for k, v in data.items():
            out.append(prefix + (k,))
            out += key_paths(v, prefix + (k,))
    return out


def set_path(data: dict, path: tuple, value) -> None:
    node = data
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[path[-1]] = value


def get_path(data: dict, path: tuple):
    for part in path:
        data = data[part]
    return data


def plausible(rng: random.Random, value):
    """Another value of the same type, often a valid one: the edits a user makes."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return rng.choice([0, 1, 2, 3, 8, 64, -1, value * 2])
    if isinstance(value, float):
        return rng.choice([0.0, 0.5, 1e-3, 2.0, -0.1, value * 10])
    if isinstance(value, str):
        return rng.choice([value, value.upper(), value + "x", "", "relax_hpc.tasks.arith.reward_func"])
    return value


def del_path(data: dict, path: tuple) -> None:
    node = data
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]


def dump(data: dict, raw: str | None = None) -> bytes:
    """The recipe text, with ``raw`` YAML text put where the data holds SLOT."""
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=10**9)
    if raw is not None:
        text = text.replace(SLOT, raw, 1)
    return text.encode("utf-8", "surrogatepass")


def special_value(rng: random.Random, workdir: Path) -> tuple[str, str, bool]:
    """(kind, raw YAML text, whether any key holding it must be refused)."""
    kind = rng.choice(["deep", "bomb", "huge", "nonfinite", "surrogate", "tag", "swap", "nul"])
    if kind == "deep":
        return kind, rng.choice([deep_list, deep_map])(rng.choice([40, 1000, 5000])), True
    if kind == "bomb":
        return kind, rng.choice([alias_bomb(), merge_bomb(), "&r [*r]", "&r {a: *r}",
                                 "[&s '" + "x" * 400 + "', " + ", ".join(["*s"] * 2000) + "]"]), True
    if kind == "huge":
        return kind, rng.choice(["[" + ", ".join(["1"] * 30000) + "]", "'" + "x" * 200_000 + "'",
                                 "{" + ", ".join(f"k{i}: {i}" for i in range(5000)) + "}"]), False
    if kind == "nonfinite":
        return kind, rng.choice(NONFINITE), True
    if kind == "surrogate":
        return kind, rng.choice(SURROGATES), True
    if kind == "tag":
        return kind, rng.choice(TAGS), False
    if kind == "nul":
        return kind, rng.choice(['"a\\0b"', '"\\x00"', '"a\\nb"', '"\\r"']), False
    return kind, rng.choice(SWAPS), False


def mutate(rng: random.Random, base: dict, workdir: Path, i: int) -> Case:
    data = yaml.safe_load(yaml.safe_dump(base))  # a fresh copy
    notes = []
    for _ in range(rng.randint(0, 2)):  # a few plain edits first
        paths = key_paths(data)
        op = rng.choice(["delete", "swap", "unknown"])
        path = rng.choice(paths)
        if op == "delete":
            del_path(data, path)
        elif op == "swap":
            set_path(data, path, plausible(rng, get_path(data, path)) if rng.random() < 0.5
                     else yaml.safe_load(rng.choice(SWAPS)))
        else:
            set_path(data, path[:-1] + (rng.choice(["nodse", "tempreature", "num_rollout", "bogus"]),), 1)
        notes.append(f"{op} {'.'.join(map(str, path))}")
    how = rng.choice(["plain", "plain", "value", "value", "override", "path", "bytes", "recipe-arg", "override-key"])
    if how == "plain":
        return Case(f"#{i} {', '.join(notes)}; plain", dump(data))
    if how in ("value", "override"):
        kind, raw, must = special_value(rng, workdir)
        path = rng.choice(key_paths(data) or [("run",)])
        key = ".".join(map(str, path))
        name = f"#{i} {', '.join(notes)}; {kind} {key} via {how}: {raw[:40]!r}"
        if how == "value":
            set_path(data, path, SLOT)
            return Case(name, dump(data, raw), key=key if must and kind in ("nonfinite", "surrogate") else None)
        return Case(name, dump(data), [f"{key}={yaml.safe_load(raw) if kind == 'surrogate' else raw}"],
                    key=key if must else None)
    if how == "path":
        key, raw = rng.choice(PATH_KEYS), wrong_paths(rng, workdir)
        if key.endswith("_path") and key.startswith(("rollout.custom_rm", "algorithm")):
            raw = raw.strip("'\"") + ":f"
        name = f"#{i} {', '.join(notes)}; {key} = {raw[:60]!r}"
        if rng.random() < 0.5:
            set_path(data, tuple(key.split(".")), SLOT)
            return Case(name, dump(data, raw if raw.startswith(("'", '"')) else f"'{raw}'"))
        return Case(name, dump(data), [f"{key}={raw}"])
    if how == "bytes":
        text = bytearray(dump(data))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(text) + 1)
            junk = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00", b"\x80abc", b":", b"{", b"]", b"&x",
                               b"*y", b"!", b"|", b"%YAML 1.1\n", b"\n---\n", b"\t", b"'", b'"', b"\n  - ", b"<<: "])
            if rng.random() < 0.2:
                del text[at:at + rng.randint(1, 40)]
            else:
                text[at:at] = junk
        return Case(f"#{i} {', '.join(notes)}; bytes", bytes(text))
    if how == "recipe-arg":
        arg = rng.choice([str(workdir / "fifo"), str(workdir), "/dev/zero", "/dev/null", str(workdir / "missing.yaml"),
                          "", "\udcff.yaml", str(workdir / "recipes" / "data" / "arith.jsonl")])
        text = rng.choice([dump(data), b"", b"---\n---\n", b"[]\n", b"x" * (2 << 20),
                           b"defaults: [" + str(workdir / "fifo").encode() + b"]\n",
                           b"defaults: [" + str(workdir).encode() + b"]\n", b'defaults: ["\\0"]\n',
                           b"defaults: [fuzz]\n", b"defaults: [" + b", ".join([b"algorithm/grpo"] * 100) + b"]\n",
                           b"defaults: 5\n", b"run: {name: x}\n"])
        use_file = rng.random() < 0.5
        return Case(f"#{i} recipe {'file' if use_file else repr(arg)}: {text[:50]!r}", text,
                    recipe=None if use_file else arg)
    bad = rng.choice(["=1", "a..b=1", "nope", ".x=1", "x" * 5000 + "=1", "a." * 40 + "b=1", "\udcff=1",
                      "roles.actor.nodes.x=1", "run=5", "run.steps==3", "roles=", "slurm.env.X=\udcff",
                      "slurm.env=" + deep_map(50), "train.lr=" + "9" * 400, "rollout.stop=[" + "'x', " * 3000 + "]"])
    return Case(f"#{i} {', '.join(notes)}; override {bad[:40]!r}", dump(data), [bad])


def cases(workdir: Path) -> list[Case]:
    rng = random.Random(SEED)
    base = yaml.safe_load(QUICKSTART.read_text())
    return [mutate(rng, base, workdir, i) for i in range(MUTATIONS)]


# ---------------------------------------------------------------------------------------------- tests ---

def test_fuzzed_recipes_are_accepted_or_refused_by_key_without_crash_or_hang(workdir):
    for local in (True, False):  # the quickstart itself is accepted in this directory
        res = dry_run(Case("quickstart as it is", QUICKSTART.read_bytes()), workdir, local)
        assert res.rc == 0, (local, res.err)
    bad, outcomes = [], {0: 0, 2: 0}
    for i, case in enumerate(cases(workdir)):
        recipe_arg = case.recipe if case.recipe is not None else str(workdir / "fuzz.yaml")
        for local in (True, False):
            as_json = not local and i % 3 == 0  # some with --json: one JSON object on stdout
            res = dry_run(case, workdir, local, as_json)
            wrong = verdict(case, res, recipe_arg, as_json)
            if wrong:
                bad.append(f"{case.name} ({'--local' if local else 'slurm'}): {wrong}\n{res.err[-600:]}")
            else:
                outcomes[res.rc] += 1
    assert not bad, f"{len(bad)} of {2 * MUTATIONS} dry runs went wrong:\n" + "\n".join(bad[:20])
    # the mutations reach past the loader: some are accepted, most refused
    assert outcomes[0] >= 30 and outcomes[2] >= 200, outcomes
    assert sorted(p.name for p in (workdir / "runs").iterdir()) == ["models"]  # no run directory made


QUICK = QUICKSTART.read_text()


@pytest.mark.parametrize("name,text,overrides,local,first,says", [
    ("deep nesting", QUICK + "extra: " + deep_list(1000) + "\n", [], True, "<yaml>", "nested more than 32 levels"),
    ("deep nesting, block style", QUICK + "extra:\n" + "".join(" " * i + "- \n" for i in range(300)), [], True,
     "<yaml>", "nested more than 32 levels"),
    ("deep override", QUICK, ["rollout.stop=" + deep_list(1000)], True, "rollout.stop", "nested more than 32"),
    ("not UTF-8", QUICK.replace("tiny-llama", "tiny-\udcffllama"), [], True, "<file>", "is not UTF-8 text"),
    ("lone surrogate in the file", QUICK.replace("path: runs/models/tiny-llama", 'path: "\\ud800"'), [], True,
     "model.path", "cannot be encoded as UTF-8"),
    ("lone surrogate on the command line", QUICK, [os.fsdecode(b"model.path=\xff")], True, "model.path",
     "cannot be encoded as UTF-8"),
    ("alias bomb", QUICK + "extra: " + alias_bomb() + "\n", [], False, "<yaml>", "alias bomb"),
    ("alias bomb as an override", QUICK, ["rollout.stop=" + alias_bomb()], False, "rollout.stop", "alias bomb"),
    ("merge-key bomb", QUICK + "extra: " + merge_bomb(24) + "\n", [], True, "<yaml>", "alias bomb"),
    ("temperature .inf", QUICK, ["rollout.temperature=.inf"], True, "rollout.temperature", "finite"),
    ("temperature .nan in the file", QUICK.replace("temperature: 1.0", "temperature: .nan"), [], False,
     "rollout.temperature", "finite"),
    ("model.path /dev/null", QUICK, ["model.path=/dev/null"], True, "model.path", "is not a directory"),
    ("model.path without config.json", QUICK, ["model.path=nomodel"], False, "model.path", "has no config.json"),
    ("recipe is a FIFO", None, [], True, "<file>", "a FIFO"),
])
def test_the_issue_cases_are_refused_by_name(workdir, name, text, overrides, local, first, says):
    recipe = workdir / "fifo" if text is None else workdir / "case.yaml"
    if text is not None:
        recipe.write_bytes(text.encode("utf-8", "surrogateescape"))
    res = dry_run(Case(name, b"", overrides, recipe=str(recipe)), workdir, local)
    assert verdict(Case(name, b"", key=first if not first.startswith("<") else None), res, str(recipe)) is None, \
        res.err
    assert res.rc == 2 and named_keys(res.err)[0] == first and says in res.err, res.err
    if first in ("<file>", "<yaml>"):
        assert str(recipe) in res.err and ("line" in res.err or first == "<file>")


def test_the_key_the_user_set_is_named_first_with_the_cluster_check(workdir):
    """``roles.actor.nodes=999`` on the 4-node cluster: the validator's batch check and the cluster check both
    run, and both name roles.actor.nodes, the key on the command line, before anything derived."""
    res = dry_run(Case("999 nodes", b"", ["roles.actor.nodes=999"], recipe=str(REPO / "recipes" / "smoke.yaml")),
                  workdir, local=False)
    keys = named_keys(res.err)
    assert res.rc == 2 and keys[:2] == ["roles.actor.nodes", "roles.actor.nodes"], res.err
    assert "partition debug has only 4 node(s)" in res.err and "999 data-parallel actor ranks" in res.err
    assert "train.global_batch_size" not in res.err
    # the user's key first, whatever order the checks found them in: the validator finds train.tp (set in the
    # file) before the cluster check finds roles.actor.nodes (set on the command line)
    (workdir / "tp.yaml").write_text(f"defaults: [{REPO / 'recipes' / 'smoke.yaml'}]\ntrain: {{tp: 2}}\n")
    res = dry_run(Case("overrides first", b"", ["roles.actor.nodes=5"], recipe=str(workdir / "tp.yaml")), workdir,
                  local=False)
    keys = named_keys(res.err)  # train.tp also for the forward roles (1 rank each), which build with it
    assert keys[0] == "roles.actor.nodes" and set(keys[1:]) == {"train.tp"} and len(keys) == 4, res.err


def test_a_cluster_that_does_not_answer_is_one_more_named_problem(tmp_path, monkeypatch):
    """Without --local and with no Slurm to ask (sinfo missing here), the dry run is refused naming the
    cluster, with the validator's problems beside it, and nothing is submitted."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo
    monkeypatch.setattr(slurm, "have_sbatch", lambda: True)
    res = dry_run(Case("no cluster", b"", ["rollout.rm_type=nope"], recipe=str(REPO / "recipes" / "smoke.yaml")),
                  tmp_path, local=False)
    assert res.rc == 2 and "Traceback" not in res.err, res.err
    assert named_keys(res.err) == ["rollout.rm_type", "<cluster>"], res.err
    assert "sinfo: not found on PATH" in res.err and "or run with --local" in res.err
