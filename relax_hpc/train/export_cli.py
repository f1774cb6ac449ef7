"""relax-export RUN [--step N] OUT_DIR: a run's checkpoint as an HF model directory that transformers loads.

Runs on a login node: one process, no GPU (they are hidden), a world-1 gloo group, the model built at TP=1, PP=1
from the run's ``model.path`` and the checkpoint loaded into it, whatever TP/PP it was saved with
(dist_checkpointing reshards); then megatron-bridge writes config and safetensors
(:func:`relax_hpc.train.export.export_checkpoint`) and the tokenizer files are copied from ``model.path``.

Everything that can refuse (no run, no checkpoint, no such step, OUT_DIR not empty or holding an input, no model, a
checkpoint whose files do not match its manifest) is checked before megatron is imported, so a mistake costs
seconds, not the model's build; weights that are not finite are refused after the load, naming the tensors. The
export is written beside OUT_DIR and renamed to it when complete (:func:`publish`), so OUT_DIR never holds a mix
and a failed export leaves it as it was. Of the run's resolved recipe (``RUN/recipe.yaml``, relax-submit's) it
reads two keys: ``model.path`` and ``train.bf16``. A LoRA run's checkpoint holds the adapters: they are exported merged into
the base model (default) or alone in PEFT's format (``--adapter``); the base model must be the one they adapt.
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.errors import PermanentError
from relax_hpc.rundir import named_like
from relax_hpc.train.latest import BrokenLatest, complete, read_latest, run_step, step_dir_name

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".index.json")
PROVENANCE = "relax_export.json"  # what was exported from where, written beside the weights


class ExportError(PermanentError):
    """An export refused before any work: the message names the run, the step and the fix."""


@dataclass(frozen=True)
class Plan:
    run: Path  # the run directory
    step_dir: Path  # the checkpoint's step directory
    step: int  # the run's step it was taken after (what relax-status and the metrics count)
    meta: dict  # its meta.json
    model_path: Path  # the run's model.path, resolved
    bf16: bool  # the run's train.bf16: the dtype the weights were saved in
    out: Path
    force: bool = False  # replace a non-empty OUT_DIR
    adapter: bool = False  # a LoRA run's adapters in PEFT's format, not the merged model


def find_run(run: str | os.PathLike) -> Path:
    """A run directory given as a path, or as a name under ``./runs``: a directory's, or a recipe's ``run.name``
    (the latest run of that name, as relax-status takes it)."""
    p = Path(run).expanduser()
    named = [] if os.sep in str(run) else sorted(
        d for d in Path("runs").glob(f"{glob.escape(str(run))}-*") if named_like(str(run)).fullmatch(d.name))
    for cand in (p, Path("runs") / p, *reversed(named)):
        if cand.is_dir() and ((cand / "recipe.yaml").exists() or (cand / "checkpoints").is_dir()):
            return cand.resolve()
    raise ExportError(f"{run} is not a run directory (no recipe.yaml nor checkpoints/ there). Fix: give the run "
                      f"directory relax-submit printed (e.g. runs/quickstart-20260101-120000)")


def find_checkpoint(run: Path, step: int | None) -> tuple[Path, int, dict]:
    """(step directory, run step, meta) of the checkpoint to export: ``checkpoints/latest``'s, or the complete one
    taken after run step ``step`` (its ``step_NNNNNNNN`` name counts optimizer steps, which can differ)."""
    root = run / "checkpoints"
    done = complete(root) if root.is_dir() else []
    if step is None:
        try:
            found = read_latest(root)
        except BrokenLatest:
            raise ExportError(f"run {run}: {root / 'latest'} names no complete checkpoint. Fix: --step with one of "
                              f"{_steps(done) if done else 'none: the run has no complete checkpoint'}") from None
        if found is None:
            more = f"; complete ones: {_steps(done)}: export one with --step" if done else ""
            raise ExportError(f"run {run} has no checkpoint ({root / 'latest'} does not exist{more}). Fix: export "
                              "after the run saved one (checkpoint.interval, or `relax-cancel --checkpoint RUN` "
                              "to save one and stop)")
        step_dir, meta = found
        return step_dir, run_step(meta), meta
    metas = {d: _meta(d) for d in done}
    hits = [d for d, m in metas.items() if run_step(m) == step] or [d for d in done if d.name == step_dir_name(step)]
    if not hits:
        raise ExportError(f"run {run} has no complete checkpoint of step {step} under {root}. Fix: --step one of "
                          f"{_steps(done) if done else 'none: the run has saved no checkpoint yet'}, or leave "
                          "--step out for the latest")
    return hits[-1], step, metas[hits[-1]]


def _meta(step_dir: Path) -> dict:
    try:
        return json.loads((step_dir / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{step_dir / 'meta.json'} cannot be read ({e}). Fix: export another step") from None


def _steps(done: list[Path]) -> str:
    return ", ".join(str(run_step(_meta(d))) for d in done) or "none"


def read_recipe_keys(run: Path) -> tuple[str | None, bool, dict]:
    """(model.path, train.bf16, run.runs_root and job.json's recipe_source) of the run's resolved recipe."""
    import yaml

    try:
        recipe = yaml.safe_load((run / "recipe.yaml").read_text()) or {}
    except FileNotFoundError:
        recipe = {}
    except (OSError, yaml.YAMLError) as e:
        raise ExportError(f"{run / 'recipe.yaml'} cannot be read ({e}). Fix: --model DIR, the run's HF model "
                          "directory") from None
    try:
        job = json.loads((run / "job.json").read_text())
    except (OSError, ValueError):
        job = {}
    where = {"runs_root": (recipe.get("run") or {}).get("runs_root"), "recipe_source": job.get("recipe_source")}
    return (recipe.get("model") or {}).get("path"), bool((recipe.get("train") or {}).get("bf16", False)), where


def resolve_model(run: Path, path: str | None, where: dict) -> Path:
    """``model.path`` as the run's roles saw it: relative paths are relative to the directory relax-submit ran in,
    found from ``run.runs_root`` (the run directory's parent is that directory / runs_root); else this directory,
    else the recipe file's."""
    if not path:
        raise ExportError(f"run {run} names no model.path in {run / 'recipe.yaml'}. Fix: --model DIR, the HF model "
                          "directory the run started from")
    p = Path(path).expanduser()
    cands = [p] if p.is_absolute() else []
    if not p.is_absolute():
        if where.get("runs_root"):
            cands += [a / p for a in run.parents if (a / where["runs_root"]).resolve() == run.parent]
        cands.append(Path.cwd() / p)
        if where.get("recipe_source"):
            cands.append(Path(where["recipe_source"]).parent / p)
    for c in cands:
        if (c / "config.json").exists():
            return c.resolve()
    raise ExportError(f"run {run}: model.path {path!r} is not an HF model directory (no config.json; looked in "
                      f"{', '.join(str(c) for c in dict.fromkeys(cands))}). Fix: --model DIR, the HF model directory "
                      "the run started from")


def check_out_dir(out: Path, force: bool, run: Path, step: int, inputs: dict[str, Path] | None = None) -> None:
    """Refuse an OUT_DIR that is a file, that is not empty (without --force), that is (or holds) one of the
    export's ``inputs`` ({what: path}), or that lies inside ``inputs["checkpoints"]``: --force replaces OUT_DIR,
    which must never take the model, the run or a checkpoint with it."""
    inputs = dict(inputs or {})
    ckpts = inputs.pop("checkpoints", None)
    if ckpts is not None and ckpts in out.parents:
        raise ExportError(f"OUT_DIR {out} is inside the run's checkpoints ({ckpts}): refusing to write the export "
                          f"of run {run} step {step} among them. Fix: a directory outside {ckpts}")
    for what, path in inputs.items():
        if path == out or out in path.parents:
            held = "is" if path == out else f"holds {path}, which is"
            raise ExportError(f"OUT_DIR {out} {held} {what}: the export of run {run} step {step} reads it, and "
                              f"{'--force would delete it' if force else 'must not be written into it'}. Fix: "
                              "a new directory outside it (e.g. beside it)")
    if out.exists() and not out.is_dir():
        raise ExportError(f"OUT_DIR {out} is a file. Fix: name a directory for the export of run {run} step {step}")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"OUT_DIR {out} is not empty: refusing to mix the export of run {run} step {step} with "
                          "what is there. Fix: a new or empty directory, or --force to replace it (its content is "
                          "deleted once the new export is complete)")


def plan(args: argparse.Namespace) -> Plan:
    run = find_run(args.run)
    step_dir, step, meta = find_checkpoint(run, args.step)
    path, bf16, where = read_recipe_keys(run)
    model = resolve_model(run, str(args.model) if args.model else path, where)
    out = Path(args.out_dir).expanduser().resolve()
    inputs = {"the run's model directory (model.path)": model, "the run directory": run,
              "the checkpoint": step_dir.resolve(), "checkpoints": (run / "checkpoints").resolve()}
    check_out_dir(out, args.force, run, step, inputs)
    adapter = bool(getattr(args, "adapter", False))
    if adapter and not meta.get("lora"):
        raise ExportError(f"run {run} step {step}: --adapter exports LoRA adapters, and this checkpoint holds a full "
                          "model (the run had no train.lora). Fix: leave --adapter out")
    return Plan(run, step_dir, step, meta, model, bf16, out, bool(args.force), adapter)


def copy_tokenizer_files(src: Path, out: Path) -> list[str]:
    """The model directory's other files (tokenizer, chat template, generation config) the export lacks."""
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    return copied


def verify_checkpoint(p: Plan) -> None:
    """The checkpoint's files against its manifest (sha256 of every file; for one saved before manifests, its
    shards' sizes), before megatron is imported; raises :class:`ExportError` naming each damaged file."""
    from relax_hpc.train import checkpoint as ckpt  # torch, not megatron
    from relax_hpc.train.manifest import damaged

    found, warning = ckpt.problems(p.step_dir, p.meta)
    if found:
        raise ExportError(f"{damaged(p.step_dir, found).what}. Fix: {_other_steps(p)}, or put back the damaged "
                          "files from a copy")
    if warning:
        print(f"relax-export: warning: {warning}", file=sys.stderr, flush=True)


def _other_steps(p: Plan) -> str:
    others = [d for d in complete(p.run / "checkpoints") if d.name != p.step_dir.name]
    return (f"export another step (--step one of {_steps(others)})" if others else
            "the run has no other complete checkpoint to export")


def export(p: Plan) -> Path:
    """Verify, build, load, write (imports megatron). Runs in this process with one gloo rank and no GPU.

    Everything is written into a new directory beside OUT_DIR, which is renamed to OUT_DIR when complete: a failed
    export leaves OUT_DIR as it was, and of two exports into one directory at once one is there whole and the
    other refused (:func:`publish`)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a login node's rules on a GPU node too: the CPU layer, gloo
    import warnings

    for cat in (FutureWarning, DeprecationWarning):  # megatron's and torch's, about their own APIs: noise here
        warnings.filterwarnings("ignore", category=cat)
    warnings.filterwarnings("ignore", module=r"megatron\.")  # "Apex is not installed", deprecations of specs
    verify_checkpoint(p)
    import torch.distributed as dist

    from relax_hpc.train import cpu_compat

    cpu_compat.compile_eagerly()  # before megatron is imported: its fused ops, eager on a CPU
    from relax_hpc.train.checkpoint import fsync_tree
    from relax_hpc.train.export import NonFiniteWeights, export_checkpoint
    from relax_hpc.train.manifest import CheckpointDamaged

    p.out.parent.mkdir(parents=True, exist_ok=True)
    stage = _new_dir(p.out, "relax-export")
    try:
        own = not dist.is_initialized()
        if own:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            export_checkpoint(p.step_dir, p.model_path, stage, bf16=p.bf16, verify=False,  # verified above
                              adapter=p.adapter)
        except CheckpointDamaged as e:  # bytes that match no manifest (an older checkpoint) and do not load
            raise ExportError(f"{e.what}. Fix: {_other_steps(p)}") from None
        except NonFiniteWeights as e:
            raise ExportError(f"{e}: refusing to export them (the training diverged before this save, or its "
                              f"files were damaged since). Fix: {_other_steps(p)}") from None
        finally:
            if own:
                dist.destroy_process_group()
        if not p.adapter:  # a PEFT adapter directory holds the adapters; its base is named in adapter_config.json
            copy_tokenizer_files(p.model_path, stage)
        (stage / PROVENANCE).write_text(json.dumps({"adapter": p.adapter, "lora": p.meta.get("lora"),
            "run": str(p.run), "step": p.step, "checkpoint": str(p.step_dir), "saved_layout": p.meta.get("layout"),
            "model_path": str(p.model_path), "dtype": "bfloat16" if p.bf16 else "float32", "time": time.time()},
            indent=1) + "\n")
        fsync_tree(stage)  # the files are durable before the rename makes them OUT_DIR
        publish(stage, p)
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # gone after a rename; an unfinished export's otherwise
    return p.out


def _new_dir(out: Path, what: str) -> Path:
    """A new directory beside ``out`` (same filesystem: a rename moves it), named for the process that made it."""
    while True:
        d = out.parent / f".{out.name}.{what}-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue


def publish(stage: Path, p: Plan) -> None:
    """Rename the finished export to OUT_DIR. rename(2) replaces only a missing or empty directory, atomically: if
    another export filled OUT_DIR meanwhile this one is refused and OUT_DIR keeps the other's, whole. --force moves
    the old OUT_DIR aside first and deletes it once the new one is in place."""
    from relax_hpc.rundir import fsync_dir

    try:
        os.rename(stage, p.out)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not p.force:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise ExportError(_filled(p)) from None
            raise
        aside = _new_dir(p.out, "relax-export-old")
        try:
            os.rename(p.out, aside)  # onto an empty directory: replaces it
        except FileNotFoundError:  # another --force export moved it aside first
            pass
        try:
            os.rename(stage, p.out)
        except OSError as e2:
            try:  # put the old export back where nothing took its place: a failed export leaves OUT_DIR as it was
                os.rename(aside, p.out)
            except OSError:  # another export's is there now: the old one goes, as with a success
                shutil.rmtree(aside, ignore_errors=True)
            if e2.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise ExportError(_filled(p)) from None
            raise
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(p.out.parent)


def _filled(p: Plan) -> str:
    try:
        other = json.loads((p.out / PROVENANCE).read_text())
        theirs = f" (its {PROVENANCE}: run {other.get('run')} step {other.get('step')})"
    except (OSError, ValueError):
        theirs = ""
    return (f"OUT_DIR {p.out} was filled by another export while this one (run {p.run} step {p.step}) ran"
            f"{theirs}: refusing to mix them; OUT_DIR keeps the other one whole and nothing of this one was left. "
            "Fix: export into another directory, or run one export at a time (--force replaces OUT_DIR)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="relax-export",
        description="Write a run's checkpoint as an HF model directory (config, safetensors, tokenizer) that "
                    "transformers loads; any TP/PP it was saved with; no GPU needed (docs/checkpoints.md).")
    ap.add_argument("run", metavar="RUN", help="the run directory (or its name under ./runs)")
    ap.add_argument("out_dir", metavar="OUT_DIR", help="where to write the HF directory (new or empty)")
    ap.add_argument("--step", type=int, default=None, metavar="N",
                    help="the run step whose checkpoint to export (default: checkpoints/latest)")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="the HF model directory the run started from (default: the run's model.path)")
    ap.add_argument("--adapter", action="store_true",
                    help="a LoRA run: write the adapters in PEFT's format (adapter_model.safetensors, "
                         "adapter_config.json) instead of the model with them merged (docs/lora.md)")
    ap.add_argument("--force", action="store_true",
                    help="replace a non-empty OUT_DIR (its content is deleted once the new export is complete)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        p = plan(args)
    except ExportError as e:
        print(f"relax-export: {e}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    layout = p.meta.get("layout") or {}
    print(f"relax-export: run {p.run.name} step {p.step} ({p.step_dir.name}, saved at TP={layout.get('tp', '?')}, "
          f"PP={layout.get('pp', '?')}) with {p.model_path} -> {p.out}", flush=True)
    t0 = time.time()
    try:
        export(p)
    except ExportError as e:
        print(f"relax-export: {e}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    except BaseException as e:  # torch's CheckpointException is a BaseException: one line, not its traceback
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        what = (str(e).strip().splitlines() or [""])[0][:500]
        print(f"relax-export: exporting run {p.run} step {p.step} ({p.step_dir}) failed: {type(e).__name__}: "
              f"{what}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    print(f"relax-export: wrote {p.out} in {time.time() - t0:.1f} s; load it with "
          f"AutoModelForCausalLM.from_pretrained({str(p.out)!r})", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
