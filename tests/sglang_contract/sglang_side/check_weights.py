"""Reads relax_hpc's weight payloads with SGLang's own code (run by SGLang's interpreter):

    python check_weights.py DIR

DIR/expected.pt: the actor's tensors by name; DIR/tensor.json: the ``serialized_named_tensors`` entries relax_hpc's
tensor path sends (one per bucket); DIR/flat.json + DIR/flat-K.bin: each bucket as ``/update_weights_from_distributed``
announces it (names, dtypes, shapes) and the bytes of the flat buffer it broadcasts. The entries are read by SGLang's
``MultiprocessingSerializer.deserialize`` (its restricted unpickler, after its ``monkey_patch_torch_reductions``, as its
TP worker reads them); the buckets by SGLang's ``FlattenedTensorBucket.empty`` (its receive buffer from the announced
names, dtypes and shapes) and ``reconstruct_tensors``. Prints one JSON line: the tensors read back and every mismatch
against the actor's (name, shape, dtype, values); exit 1 on a mismatch."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import boot  # noqa: E402,F401 - before sglang

import torch  # noqa: E402

from sglang.srt.utils.common import MultiprocessingSerializer  # noqa: E402
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # noqa: E402
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket  # noqa: E402


def compare(named, expected, where, problems, seen):
    for name, t in named:
        want = expected.get(name)
        if want is None:
            problems.append(f"{where}: {name} is not one of the actor's tensors")
        elif t.dtype != want.dtype or tuple(t.shape) != tuple(want.shape):
            problems.append(f"{where}: {name} came back {t.dtype} {tuple(t.shape)}, the actor's is "
                            f"{want.dtype} {tuple(want.shape)}")
        elif not torch.equal(t, want):
            problems.append(f"{where}: {name} came back with other values")
        seen.add(name)


def main(d):
    expected = torch.load(os.path.join(d, "expected.pt"))
    problems, got = [], {"tensor": set(), "flattened_bucket": set()}
    if os.path.exists(os.path.join(d, "tensor.json")):
        monkey_patch_torch_reductions()
        for k, entry in enumerate(json.load(open(os.path.join(d, "tensor.json")))):
            try:
                named = MultiprocessingSerializer.deserialize(entry)
            except Exception as e:  # noqa: BLE001 - reported as the contract failure
                problems.append(f"tensor entry {k}: SGLang cannot deserialize it: {type(e).__name__}: {e}")
                continue
            compare(named, expected, f"tensor entry {k}", problems, got["tensor"])
    if os.path.exists(os.path.join(d, "flat.json")):
        for k, b in enumerate(json.load(open(os.path.join(d, "flat.json")))):
            try:
                bucket = FlattenedTensorBucket.empty(b["names"], b["dtypes"], b["shapes"], "cpu")
                buf = bucket.get_flattened_tensor()
                raw = open(os.path.join(d, f"flat-{k}.bin"), "rb").read()
                if len(raw) != buf.numel():
                    raise ValueError(f"the broadcast buffer is {len(raw)} bytes, SGLang's receive buffer for the "
                                     f"announced names/dtypes/shapes is {buf.numel()}")
                buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
                named = bucket.reconstruct_tensors()
            except Exception as e:  # noqa: BLE001
                problems.append(f"bucket {k}: {type(e).__name__}: {e}")
                continue
            compare(named, expected, f"bucket {k}", problems, got["flattened_bucket"])
    print(json.dumps({"problems": problems, "read": {k: sorted(v) for k, v in got.items()}}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
