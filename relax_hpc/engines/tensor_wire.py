"""The wire format of ``/update_weights_from_tensor``: SGLang's ``MultiprocessingSerializer`` form of a list of
``(name, tensor)``, said in one place for the sender (:mod:`relax_hpc.weights`) and the engine
(:mod:`relax_hpc.engines.receiver`). Its sibling for ``/update_weights_from_distributed``'s flattened bucket is
:mod:`relax_hpc.engines.bucket_wire`.

An entry is the base64 text of a :class:`multiprocessing.reduction.ForkingPickler` dump of the list (raw bytes are
taken too, as SGLang takes them). The pickle carries no tensor data, only handles: a CUDA tensor becomes a CUDA IPC
handle (the receiver maps the sender's memory on the same GPU), a CPU tensor a shared-memory file name (the
``file_system`` sharing strategy, so that a process the sender did not start can open it). The sender keeps the
tensors alive until the receiver's call returns.

**An entry is good for one load.** Pickling takes one reference on the shared block (torch's shared-memory
refcount on the CPU, the CUDA IPC ref counter on the GPU) and loading gives it back. Serialize once per receiving
rank (each engine, each TP rank): an entry loaded twice gives back a reference it never took, which unlinks the
CPU block for good (the next load, even of a fresh entry of the same tensor, fails: "unable to open shared memory
object") or lets the sender's CUDA allocator reuse a block another process still reads. The engine loads an entry
even when it then refuses the call (outside a session, memory released), so no reference is left behind.

Reading is restricted (:func:`deserialize_named`): the unpickler resolves only what a tensor list needs (torch's
``rebuild_*`` functions of :mod:`torch.multiprocessing.reductions`, tensor, storage and ``Size`` classes, dtypes),
so a pickle naming anything else (``os.system``, ...) is refused with a :class:`ValueError` naming that global,
before anything runs.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import pickle

import torch

# torch.multiprocessing.reductions' rebuilders a dense tensor list uses (CPU through a shared-memory file, CUDA
# through an IPC handle, empty storages, parameters); rebuild_storage_fd is left out: its file descriptor cannot
# reach a process the sender did not start (use the file_system strategy, as serialize_named does)
_REBUILDERS = frozenset({
    "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
    "rebuild_storage_filename", "rebuild_storage_empty",
})
_TENSOR_CLASSES = {("torch", "Tensor"), ("torch._tensor", "Tensor"), ("torch", "Size"),
                   ("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"),
                   ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"), ("torch", "TypedStorage")}
_STORAGE_MODULES = ("torch", "torch.storage", "torch.cuda")  # legacy typed storages (torch.FloatStorage, ...)


def serialize_named(named: list[tuple[str, torch.Tensor]]) -> str:
    """``named`` as one entry of ``serialized_named_tensors``: base64 of a ForkingPickler dump. CPU tensors are
    moved into shared memory (sharing strategy ``file_system``, set here for this process); CUDA tensors become
    IPC handles. One entry per receiving rank, loaded once (module docstring); keep the tensors alive until the
    engine's call returns."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp  # registers torch's reducers with ForkingPickler

    if any(t.device.type == "cpu" for _, t in named):
        tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump([(str(n), t) for n, t in named])
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _TensorUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals a tensor list needs; anything else is a ValueError. With
    ``cuda_index``, CUDA handles are opened on that device of this process."""

    def __init__(self, f, cuda_index: int | None = None):
        super().__init__(f)
        self.cuda_index = cuda_index

    def find_class(self, module: str, name: str):
        if module == "torch.multiprocessing.reductions" and name in _REBUILDERS:
            import torch.multiprocessing.reductions as r
            if name == "rebuild_cuda_tensor" and self.cuda_index is not None:
                return functools.partial(_rebuild_cuda_on, self.cuda_index)
            return getattr(r, name)
        if (module, name) in _TENSOR_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _STORAGE_MODULES and name.endswith("Storage"):
            cls = super().find_class(module, name)
            if isinstance(cls, type) and issubclass(cls, (torch.storage.TypedStorage, torch.UntypedStorage)):
                return cls
        raise ValueError(f"refused to unpickle global {module}.{name}: a serialized tensor list may name only "
                         "torch's tensor rebuilders, tensor and storage classes, torch.Size and dtypes")


def _rebuild_cuda_on(index: int, *args):
    """torch's ``rebuild_cuda_tensor`` with the storage's device (its 7th argument: the index the *sender's* process
    knew the GPU by) replaced by ``index``, this process's index of that GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(args)
    args[6] = index
    return rebuild_cuda_tensor(*args)


def deserialize_named(data: str | bytes, device: str | torch.device | None = None) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` list of one ``serialized_named_tensors`` entry (base64 text, or the raw pickle as
    bytes), read with the restricted unpickler. ValueError if it is not such a list or names a global it may not.

    ``device``: a CUDA device of this process: CUDA handles are opened there, whatever index the sender's process
    knew its GPU by (two processes with different ``CUDA_VISIBLE_DEVICES`` number one GPU differently; the sender
    uses handles only for a receiver on its own GPU, by UUID). None: the sender's index, as torch does."""
    import torch.multiprocessing  # noqa: F401 - the rebuilders' module, imported before they are looked up

    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"a serialized_named_tensors entry is not base64: {e}") from None
    try:
        dev = torch.device(device) if device is not None else None
        cuda_index = (dev.index or 0) if dev is not None and dev.type == "cuda" else None
        obj = _TensorUnpickler(io.BytesIO(data), cuda_index).load()
    except ValueError:
        raise
    except Exception as e:  # a truncated or foreign pickle, a handle that does not open
        raise ValueError(f"cannot read the serialized tensors: {type(e).__name__}: {e}") from e
    if not isinstance(obj, (list, tuple)) or not all(
            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)
            for x in obj):
        raise ValueError(f"the serialized object is a {type(obj).__name__}, not a list of (name, tensor) pairs")
    return [(n, t) for n, t in obj]
