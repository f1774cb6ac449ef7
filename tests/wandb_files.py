"""Read back what W&B wrote offline (``run-*.wandb``): the tests' check that the metrics really went there.

The file is W&B's datastore: a 7-byte header (``:W&B``, magic 0xBEE1, version), then LevelDB's log format (32 KiB
blocks; each record a 7-byte header of CRC, length and type: FULL, or FIRST/MIDDLE…/LAST across blocks) whose
payloads are ``wandb_internal_pb2.Record`` messages. wandb's Python package no longer ships a reader.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B datastore"
    out, pos, parts = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zero padding
            pos += left
            continue
        payload = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            parts = payload
        elif kind == FIRST:
            parts = payload
            continue
        elif kind == MIDDLE:
            parts += payload
            continue
        elif kind == LAST:
            parts += payload
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(parts)
        out.append(rec)
    return out


def history(path: str | Path) -> list[dict]:
    """The rows ``run.log`` wrote, each a dict of key -> value (JSON-decoded)."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item})
    return rows


def summary(path: str | Path) -> dict:
    out: dict = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "summary":
            for item in rec.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def exit_code(path: str | Path) -> int | None:
    codes = [rec.exit.exit_code for rec in records(path) if rec.WhichOneof("record_type") == "exit"]
    return codes[-1] if codes else None


def run_files(run_dir: str | Path, timeout_s: float = 60.0) -> list[Path]:
    """The ``run-*.wandb`` files of a run directory, oldest attempt first, once each holds its exit record: W&B's
    service process may still be writing a file when ``run.finish()`` has returned (seen on a loaded machine)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
        if all(_complete(f) for f in files) or time.monotonic() > deadline:
            return files
        time.sleep(0.2)


def _complete(path: Path) -> bool:
    try:
        return exit_code(path) is not None
    except Exception:  # a record cut in the middle of its write
        return False
