"""LoRA adapters on the reference engine: ``train.lora.mode: adapter``'s weight sync sends only the adapters.

What arrives, by the weight-sync paths the engine already serves (``/update_weights_from_distributed``, ``_tensor``)
or by SGLang's ``/load_lora_adapter_from_tensors`` (PEFT's ``adapter_config.json`` and the tensors in the
:mod:`~relax_hpc.engines.tensor_wire` form): per targeted HF module ``M``, ``M.lora_A.weight`` [r, in] and
``M.lora_B.weight`` [out, r]. Over the weight-sync paths B comes already scaled by alpha / r (the actor scales it:
the engine needs no config); by ``/load_lora_adapter_from_tensors`` the config's ``lora_alpha / r`` scales it here.

The engine serves one adapter, applied to every request (the RL policy is the one adapter): it keeps a copy of each
targeted base weight ``W0`` the first time an adapter reaches it and serves ``W0 + B @ A``; a later adapter
replaces the earlier one from the same ``W0``, so no error accumulates over steps. A full weight of a module that
carries an adapter (a merged sync) becomes its new ``W0``. ``/get_weights_by_name`` answers an adapter's name with
what was loaded (the actor's fingerprint check reads it as it reads any weight).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SUFFIXES = (".lora_A.weight", ".lora_B.weight")
# the adapter's name on every engine in train.lora.mode adapter: SGLang applies a loaded adapter only to the requests
# that name it, so every /generate of such a run carries it (:func:`generate_fields`), and each sync swaps the adapter
# under this one name (relax_hpc.weights.lora.AdapterDirSync)
LORA_NAME = "relax-lora"


def generate_fields(recipe) -> dict:
    """The fields every ``/generate`` of a run carries for its LoRA adapter: SGLang's ``lora_path`` (the name of a
    loaded adapter) in ``train.lora.mode: adapter``; nothing otherwise (merged weights serve every request). The
    reference engine serves its one adapter to every request and takes the field as SGLang does."""
    lora = getattr(getattr(recipe, "train", None), "lora", None)
    return {"lora_path": LORA_NAME} if lora is not None and lora.mode == "adapter" else {}


def is_adapter(name: str) -> bool:
    return name.endswith(SUFFIXES)


def module_of(name: str) -> tuple[str, str]:
    """(the base weight's name, "A" or "B") of an adapter tensor's name."""
    for s, ab in zip(SUFFIXES, ("A", "B")):
        if name.endswith(s):
            return name[: -len(s)] + ".weight", ab
    raise ValueError(f"{name!r} is not a LoRA adapter tensor (…{SUFFIXES[0]} or …{SUFFIXES[1]})")


class EngineAdapters:
    """The adapters an engine serves, merged into its weights (module docstring)."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}  # base weight name → W0 (a copy, kept while an adapter is on it)
        self.ab: dict[str, dict[str, torch.Tensor]] = {}  # base weight name → {"A": ..., "B": ...}, as loaded
        self.loads = 0  # adapter loads served

    def split(self, named: list[tuple[str, torch.Tensor]]) -> tuple[list, list]:
        ad = [(n, t) for n, t in named if is_adapter(n)]
        return ad, [(n, t) for n, t in named if not is_adapter(n)]

    def load(self, named: list[tuple[str, torch.Tensor]], params: dict[str, torch.Tensor],
             param: Callable[[str], tuple[str, torch.Tensor]], load_full: Callable[[list], None], *,
             scale: float = 1.0) -> None:
        """Load ``named``: full weights through ``load_full`` (the receiver's own copy; a module carrying an
        adapter takes it as its new base), adapters merged (B × ``scale``). Everything is checked (names, shapes)
        before anything changes; raises ValueError naming the first problem. The caller holds no lock."""
        adapters, full = self.split(named)
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for n, t in adapters:
            base_name, ab = module_of(n)
            key, p = param(base_name)  # a 400 naming it where the model has no such weight
            pending.setdefault(key, {})[ab] = t
        for key, parts in pending.items():
            have = {**self.ab.get(key, {}), **parts}
            if set(have) != {"A", "B"}:
                raise ValueError(f"adapter of {key}: lora_A and lora_B must both be sent (got only "
                                 f"{', '.join(sorted(have))})")
            a, b = have["A"], have["B"]
            out_f, in_f = params[key].shape
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter of {key} does not fit its weight {tuple(params[key].shape)}: lora_A "
                                 f"{tuple(a.shape)}, lora_B {tuple(b.shape)} (want [r, {in_f}] and [{out_f}, r])")
        if full:
            load_full(full)
            for n, _t in full:
                key, p = param(n)
                if key in self.base:  # a merged sync of an adapted module: its new W0
                    self.base[key] = p.detach().clone()
                    if key not in pending:
                        pending[key] = {}
        with torch.no_grad():
            for key, parts in pending.items():
                have = self.ab.setdefault(key, {})
                for ab, t in parts.items():
                    have[ab] = (t * scale if ab == "B" else t).detach().to("cpu", torch.float32).clone()
                if key not in self.base:
                    self.base[key] = params[key].detach().clone()
                w0 = self.base[key]
                delta = have["B"].to(w0.device, torch.float32) @ have["A"].to(w0.device, torch.float32)
                params[key].data.copy_((w0.float() + delta).to(w0.dtype))
        if adapters:
            self.loads += 1

    def unload(self, params: dict[str, torch.Tensor]) -> int:
        """Every adapted weight back to its base ``W0``, the adapters forgotten; how many weights it restored."""
        with torch.no_grad():
            for key, w0 in self.base.items():
                params[key].data.copy_(w0)
        n = len(self.base)
        self.base, self.ab = {}, {}
        return n

    def get(self, name: str) -> torch.Tensor | None:
        """An adapter tensor as loaded (B scaled), or None for a name that is not a loaded adapter's."""
        if not is_adapter(name):
            return None
        base_name, ab = module_of(name)
        for key, have in self.ab.items():
            if key == base_name or key.endswith(base_name):
                return have.get(ab)
        return None

    def state(self) -> dict:
        return {"lora_adapters": len(self.ab), "lora_adapter_loads": self.loads}


def peft_scale(config: dict) -> float:
    """PEFT's scaling of an ``adapter_config.json``: lora_alpha / r (rsLoRA: lora_alpha / sqrt(r))."""
    r = float(config.get("r") or 0)
    alpha = float(config.get("lora_alpha") or 0)
    if r <= 0 or alpha <= 0:
        raise ValueError(f"config_dict must hold PEFT's r and lora_alpha, both positive (got r={config.get('r')}, "
                         f"lora_alpha={config.get('lora_alpha')})")
    return alpha / (r ** 0.5 if config.get("use_rslora") else r)


def peft_key(name: str) -> str:
    """A PEFT saved key (``base_model.model.model.layers.0...lora_A.weight``) as the model's checkpoint name."""
    return name.removeprefix("base_model.model.")


class AdapterServing:
    """What a :class:`~relax_hpc.engines.receiver.WeightReceiver` (the CPU engine) adds to serve adapters: adapter
    names in the weight-sync updates and their read-back, and SGLang's ``/load_lora_adapter_from_tensors``."""

    @property
    def adapters(self) -> EngineAdapters:
        if getattr(self, "_adapters", None) is None:
            self._adapters = EngineAdapters()
        return self._adapters

    def load_named(self, named: list) -> None:
        from relax_hpc.engines.http import HTTPError

        if not any(is_adapter(n) for n, _ in named) and not self.adapters.base:  # no adapter here, nor ever
            return super().load_named(named)
        try:
            with self.model_lock:
                if (why := self.updates_refused()) is not None:
                    raise HTTPError(400, why)
            self.adapters.load(named, self.params, self.param, super().load_named, scale=getattr(self, "_scale", 1.0))
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        if any(is_adapter(n) for n, _ in named):  # full weights alone: load_full reported them already
            self.loaded(named)

    def get_weights_by_name(self, body: dict):
        got = self.adapters.get(str(body.get("name")))
        if got is None:
            return super().get_weights_by_name(body)
        return got[: int(body.get("truncate_size", 100))].float().tolist()

    def load_lora_adapter(self, body: dict) -> tuple[bool, str]:
        """SGLang's ``/load_lora_adapter``: ``lora_name`` and ``lora_path``, a PEFT directory this engine can read
        (``adapter_config.json``, ``adapter_model.safetensors``; the run's shared filesystem). One adapter at a
        time, as :meth:`load_lora_adapter_from_tensors`; a name already loaded is refused as SGLang refuses it
        (unload it first)."""
        import json
        from pathlib import Path

        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return False, "lora_name and lora_path must be non-empty strings"
        if getattr(self, "_lora_name", None) == name:
            return False, f"Failed to load LoRA adapter {name} because it is already loaded"
        try:
            from safetensors.torch import load_file

            config = json.loads((Path(path) / "adapter_config.json").read_text())
            scale = peft_scale(config if isinstance(config, dict) else {})
            named = [(peft_key(n), t) for n, t in load_file(str(Path(path) / "adapter_model.safetensors")).items()]
        except (OSError, ValueError) as e:  # a missing file, bad JSON, a damaged safetensors file
            return False, f"Failed to load LoRA adapter {name!r} from {path}: {e}"
        ok, message = self._load_peft(name, named, scale)
        if ok:
            self._lora_name = name
        return ok, message

    def unload_lora_adapter(self, body: dict) -> tuple[bool, str]:
        """SGLang's ``/unload_lora_adapter``: ``lora_name``; the adapted weights go back to the base model."""
        from relax_hpc.engines.http import HTTPError

        name, have = body.get("lora_name"), getattr(self, "_lora_name", None)
        if not isinstance(name, str) or name != have:
            return False, f"LoRA adapter {name!r} is not loaded (loaded: {have!r})"
        with self.model_lock:
            if (why := self.updates_refused()) is not None:
                raise HTTPError(400, why)
            n = self.adapters.unload(self.params)
        self._lora_name = None
        return True, f"Unloaded LoRA adapter {name!r} ({n} weights back to the base model)."

    def _load_peft(self, name, named: list, scale: float) -> tuple[bool, str]:
        """Load PEFT-named adapter tensors (already as the model names them) with PEFT's ``scale``."""
        from relax_hpc.engines.http import HTTPError

        bad = [n for n, _ in named if not is_adapter(n)]
        if bad:
            return False, f"Failed to load LoRA adapter: {bad[0]!r} is not a lora_A/lora_B tensor"
        self._scale = scale
        try:
            self.load_named(named)
        except HTTPError as e:
            return False, f"Failed to load LoRA adapter {name!r}: {e.message}"
        finally:
            self._scale = 1.0
        return True, f"Loaded LoRA adapter {name!r} ({len(named)} tensors)."

    def load_lora_adapter_from_tensors(self, body: dict) -> tuple[bool, str]:
        """SGLang's ``/load_lora_adapter_from_tensors``: ``lora_name``, ``config_dict`` (PEFT's adapter_config),
        ``serialized_named_tensors`` (one tensor_wire entry: TP 1 here). This engine serves one adapter, on every
        request: a later load replaces it (module docstring)."""
        from relax_hpc.engines.tensor_wire import deserialize_named

        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], str):
            return False, "serialized_named_tensors must be a list of one base64 string (this engine has TP 1)"
        try:  # opened first: an opened handle is released, an unopened one leaked (tensor_wire)
            named = [(peft_key(n), t) for n, t in deserialize_named(entries[0])]
            scale = peft_scale(body.get("config_dict") or {})
        except ValueError as e:
            return False, f"Failed to load LoRA adapter {body.get('lora_name')!r}: {e}"
        return self._load_peft(body.get("lora_name"), named, scale)
