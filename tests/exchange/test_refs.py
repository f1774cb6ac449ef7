"""The refs module: the chunk and side-file refs that control messages carry, without the chunk format's h5py."""

from __future__ import annotations

import json
import subprocess
import sys

from relax_hpc.exchange import ChunkRef as ExportedChunkRef
from relax_hpc.exchange import chunk as chunkmod
from relax_hpc.exchange.refs import ChunkRef, SideRef


def _loaded_after(module: str) -> dict[str, bool]:
    """Which heavy modules a fresh interpreter has loaded after importing ``module`` (nothing else)."""
    code = (f"import sys, json, {module}\n"
            "print(json.dumps({m: m in sys.modules for m in ('h5py', 'numpy', 'relax_hpc.exchange.chunk')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_control_messages_and_the_refs_load_no_h5py():
    for module in ("relax_hpc.controller.messages", "relax_hpc.exchange.refs"):
        assert _loaded_after(module) == {"h5py": False, "numpy": False, "relax_hpc.exchange.chunk": False}, module


def test_the_refs_are_the_same_classes_everywhere_and_survive_the_wire():
    assert chunkmod.ChunkRef is ChunkRef and chunkmod.SideRef is SideRef and ExportedChunkRef is ChunkRef
    side = SideRef(chunk="step_3/chunk_rollout_0", writer="reference", file="chunk_rollout_0.reference.0a1b2c3d.h5",
                   fields=("ref_log_probs",), checksum="crc32c:0a1b2c3d", size=4096)
    ref = ChunkRef(path="/x/exchange/step_3/chunk_rollout_0.h5", step=3, n=2, fields=("tokens",),
                   checksum="crc32c:00000001", size=8192, attrs={"group_size": 2}).with_side(side)
    back = ChunkRef.from_dict(json.loads(json.dumps(ref.to_dict())))
    assert back == ref and back.attrs == {"group_size": 2} and back.sides == (side,)
    assert back.id == "step_3/chunk_rollout_0" and back.all_fields == {"tokens", "ref_log_probs"}
    assert str(back.file_of("ref_log_probs")[0]) == "/x/exchange/step_3/chunk_rollout_0.reference.0a1b2c3d.h5"
