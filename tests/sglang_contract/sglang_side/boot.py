"""Imported first by every program the contract tests run under SGLang's interpreter (``RELAX_SGLANG_PYTHON``).

One accommodation, for a CPU-only SGLang environment only: ``import sglang`` imports ``torchvision`` (through
transformers' image utilities), and torchvision's import registers fake kernels for its ``nms``/``qnms`` operators,
which fails when its compiled operators do not load (PyPI's Linux torchvision is a CUDA build; against a CPU torch its
``_C.so`` cannot load). Where that is the case, and only then, the two operator schemas are declared here so that the
import goes through; nothing of SGLang is touched, and nothing here calls those operators. With a torchvision whose
operators load (the CPU build from PyTorch's CPU index, or any GPU install) this does nothing.
"""

import importlib.util
import os
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _torchvision_ops_missing() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    import torch

    here = list(spec.submodule_search_locations)[0]
    lib = next((os.path.join(here, f) for f in sorted(os.listdir(here)) if f.startswith("_C") and f.endswith(".so")),
               None)
    if lib is None:
        return True
    try:
        torch.ops.load_library(lib)
    except (OSError, RuntimeError):
        return True
    return False


if _torchvision_ops_missing():
    import torch

    _LIB = torch.library.Library("torchvision", "DEF")  # kept alive: the schemas live as long as this object
    for _schema in ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"):
        _LIB.define(_schema)
    TORCHVISION_SHIM = True
else:
    TORCHVISION_SHIM = False
