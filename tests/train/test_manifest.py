"""relax_hpc.train.manifest on plain directories (no torch): what it lists, how it splits the check over ranks, and
each way a checkpoint's files can differ from what its save wrote. Real checkpoints: test_export_integrity.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from relax_hpc.train import manifest


def step_dir(root: Path) -> Path:
    d = root / "step_00000003"
    (d / "rng").mkdir(parents=True)
    for name, data in (("__0_0.distcp", b"a" * 100), ("__1_0.distcp", b"b" * 100), (".metadata", b"m"),
                       ("common.pt", b"c"), ("rng/rank_00000.pt", b"r0"), ("rng/rank_00001.pt", b"r1")):
        (d / name).write_bytes(data)
    (d / "meta.json").write_text(json.dumps({"step": 3, "manifest": manifest.MANIFEST}))
    return d


def test_a_written_manifest_lists_every_file_and_sha256sum_reads_it(tmp_path):
    d = step_dir(tmp_path)
    names = manifest.listing(d)
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "rng/rank_00000.pt",
                     "rng/rank_00001.pt"]  # not meta.json (written after it)
    assert manifest.own_files(d, 1) == ["__1_0.distcp", "rng/rank_00001.pt"]
    manifest.write(d, manifest.hash_files(d, names))
    assert manifest.listing(d) == names  # nor the manifest itself
    line = (d / manifest.MANIFEST).read_text().splitlines()[1]
    assert line == f"{hashlib.sha256(b'a' * 100).hexdigest()}  __0_0.distcp"  # sha256sum's format
    assert manifest.check(d, json.loads((d / "meta.json").read_text())) == ([], True)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_the_ranks_shares_cover_every_file_once(world):
    names = [f"f{i}" for i in range(10)]
    shares = [manifest.share(names, r, world) for r in range(world)]
    assert sorted(n for s in shares for n in s) == names


def test_each_difference_is_named(tmp_path):
    d = step_dir(tmp_path)
    manifest.write(d, manifest.hash_files(d, manifest.listing(d)))
    digests = manifest.read(d)
    (d / "__0_0.distcp").write_bytes(b"a" * 99 + b"b")  # same size, other bytes
    (d / "__1_0.distcp").write_bytes(b"b" * 10)  # truncated
    (d / "common.pt").unlink()
    bad = manifest.verify(d, digests)
    assert len(bad) == 3
    assert bad[0].startswith(f"{d / '__0_0.distcp'} (100 bytes) has sha256 ")
    assert bad[1].startswith(f"{d / '__1_0.distcp'} (10 bytes) has sha256 ") and "truncated" in bad[1]
    assert bad[2] == f"{d / 'common.pt'} is missing"
    # each rank of two checks its share only: .metadata, __1_0, rng 0 | __0_0, common.pt, rng 1
    assert manifest.verify(d, digests, manifest.share(list(digests), 0, 2)) == [bad[1]]
    assert manifest.verify(d, digests, manifest.share(list(digests), 1, 2)) == [bad[0], bad[2]]


def test_a_missing_or_malformed_manifest(tmp_path):
    d = step_dir(tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    found, has = manifest.check(d, meta)  # meta.json says the save wrote one: deleting it does not pass
    assert has and found == [f"{d / manifest.MANIFEST} is missing, though {d / 'meta.json'} says the save wrote it"]
    assert manifest.check(d, {"step": 3}) == ([], False)  # saved before manifests: the caller warns
    (d / manifest.MANIFEST).write_text(f"{'0' * 64}  ../../etc/passwd\n")
    found, has = manifest.check(d, meta)
    assert has and "line 1 is not '<sha256>  <file>'" in found[0]
    err = manifest.damaged(d, found, "export another step")
    assert isinstance(err, manifest.CheckpointDamaged) and err.permanent
    assert str(err).startswith(f"checkpoint {d} is damaged: ") and str(err).endswith(". Fix: export another step")
