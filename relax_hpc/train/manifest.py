"""A checkpoint's sha256 manifest: which bytes the save wrote, so a resume or an export reads those or refuses.

A torch_dist checkpoint is a directory of files (``*.distcp``, ``.metadata``, ``common.pt``, ``rng/…``) that no
format checks: a flipped bit loads as a wrong (or NaN) weight, a truncated file as an ``EOFError`` naming nothing.
:func:`relax_hpc.train.checkpoint.save` writes ``step_NNNNNNNN/manifest.sha256`` once every file is written and
fsynced, before ``meta.json`` (which records that there is one); every rank hashes the files it wrote, so the cost
is shared. The manifest is ``sha256sum``'s format: ``cd step_NNNNNNNN && sha256sum -c manifest.sha256`` checks it
by hand. ``meta.json`` and the manifest itself are written after it and not in it.

A checkpoint whose ``meta.json`` names no manifest was saved before manifests existed: it loads with a warning.
One that names a manifest which is gone is refused (deleting it must not switch the check off).

Pure Python (hashlib), no torch: ``relax-export`` checks a checkpoint before it imports megatron.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from relax_hpc.errors import PermanentError

MANIFEST = "manifest.sha256"
NOT_LISTED = ("meta.json", MANIFEST)  # written after the manifest


class CheckpointDamaged(PermanentError):
    """A checkpoint's bytes are not those its save wrote (or cannot be loaded): reading it again reads the same
    bytes, so a restart cannot help. ``what`` names the step directory and the files; the message adds the fix,
    which differs between a resume and an export."""

    def __init__(self, what: str, fix: str = ""):
        super().__init__(f"{what}. Fix: {fix}" if fix else what)
        self.what, self.fix = what, fix


def listing(step_dir: str | os.PathLike) -> list[str]:
    """The files of a step directory the manifest covers, relative, sorted (``rng/rank_00000.pt`` …)."""
    root = Path(step_dir)
    out = []
    for d, _dirs, files in os.walk(root):
        for name in files:
            rel = (Path(d) / name).relative_to(root).as_posix()
            if rel not in NOT_LISTED and not name.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_files(step_dir: str | os.PathLike, names: list[str]) -> dict[str, str]:
    return {n: sha256(Path(step_dir) / n) for n in names}


def own_files(step_dir: str | os.PathLike, rank: int) -> list[str]:
    """The files rank ``rank`` wrote in a save: its ``__RANK_*.distcp`` shards (dist_checkpointing's naming) and its
    RNG state. Hashing them on the writer reads them from its page cache; rank 0 hashes whatever else is there."""
    root = Path(step_dir)
    mine = [p.name for p in root.glob(f"__{rank}_*.distcp") if p.is_file()]
    rng = f"rng/rank_{rank:05d}.pt"
    return sorted(mine + ([rng] if (root / rng).is_file() else []))


def write(step_dir: str | os.PathLike, digests: dict[str, str]) -> Path:
    """``MANIFEST`` in ``step_dir``, fsynced, moved into place whole (a reader sees all of it or none)."""
    root = Path(step_dir)
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(f"{digests[n]}  {n}\n" for n in sorted(digests))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)
    return root / MANIFEST


def read(step_dir: str | os.PathLike) -> dict[str, str] | None:
    """{relative path: sha256} of the manifest; None if there is none. A malformed one raises
    :class:`CheckpointDamaged`."""
    path = Path(step_dir) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointDamaged(f"{path} cannot be read ({e})", "") from None
    out = {}
    for i, line in enumerate(text.splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name or name.startswith("/") or ".." in Path(name).parts:
            raise CheckpointDamaged(f"{path} line {i} is not '<sha256>  <file>': {line[:100]!r}")
        out[name] = digest
    return out


def share(names: list[str], rank: int, world: int) -> list[str]:
    """This rank's part of a verification: every rank computes the same split from the same manifest."""
    return [n for i, n in enumerate(sorted(names)) if i % world == rank]


def verify(step_dir: str | os.PathLike, digests: dict[str, str], names: list[str] | None = None) -> list[str]:
    """What is wrong with ``names`` (default: every file the manifest lists): one line per file, naming it;
    [] if each has the bytes the save wrote."""
    root = Path(step_dir)
    bad = []
    for n in sorted(digests) if names is None else names:
        path = root / n
        try:
            size = path.stat().st_size
            got = sha256(path)
        except FileNotFoundError:
            bad.append(f"{path} is missing")
            continue
        except OSError as e:
            bad.append(f"{path} cannot be read ({e})")
            continue
        if got != digests[n]:
            bad.append(f"{path} ({size} bytes) has sha256 {got[:16]}…, the manifest says {digests[n][:16]}…: "
                       "changed or truncated since the save")
    return bad


def check(step_dir: str | os.PathLike, meta: dict, rank: int = 0, world: int = 1) -> tuple[list[str], bool]:
    """(what is wrong with this rank's share of the files, whether the checkpoint has a manifest at all).

    Never raises: a collective caller gathers every rank's list before anyone refuses (a rank that raised alone
    would leave the others waiting in the gather)."""
    root = Path(step_dir)
    try:
        digests = read(root)
    except CheckpointDamaged as e:
        return [str(e)], True
    if digests is None:
        if meta.get("manifest"):
            return [f"{root / MANIFEST} is missing, though {root / 'meta.json'} says the save wrote it"], True
        return [], False
    return verify(root, digests, share(list(digests), rank, world)), True


def damaged(step_dir: str | os.PathLike, problems: list[str], fix: str = "") -> CheckpointDamaged:
    shown = problems[:5] + ([f"and {len(problems) - 5} more"] if len(problems) > 5 else [])
    return CheckpointDamaged(f"checkpoint {step_dir} is damaged: {'; '.join(shown)}", fix)
