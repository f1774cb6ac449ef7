"""``train.lora.mode: adapter``: the weight sync sends the LoRA adapters only (docs/lora.md).

The actor's model carries its LoRA record on each GPTModel chunk (:mod:`relax_hpc.train.lora` sets it; read here by
attribute, as this package does not import the trainer). In ``adapter`` mode the sync's tensors are
megatron-bridge's adapter export under HF module names (``…q_proj.lora_A.weight``, ``…q_proj.lora_B.weight``), B
scaled by alpha / rank so the engine merges ``W0 + B @ A`` without the config (:mod:`relax_hpc.engines.lora`); in
``merge`` mode (and without LoRA) the model's merged HF weights, as for full fine-tuning.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LORA_ATTR = "_relax_lora"  # relax_hpc.train.lora.LORA_ATTR


def lora_record(model: Any) -> dict | None:
    """The LoRA record of a :class:`~relax_hpc.train.actor.MegatronActor`'s model (chunks maybe in DDP), or None."""
    chunks = getattr(model, "model", None)
    if not isinstance(chunks, (list, tuple)):  # not a MegatronActor (an HF model handed to the sync): no LoRA
        return None
    for chunk in chunks:
        m = chunk
        while m is not None:
            rec = getattr(m, LORA_ATTR, None)
            if rec:
                return rec
            m = getattr(m, "module", None)
    return None


def adapter_mode(model: Any) -> bool:
    rec = lora_record(model)
    return bool(rec) and rec["mode"] == "adapter"


def sync_weights(model: Any) -> Iterator[tuple[str, Any]]:
    """What a sync sends of ``model`` (collective, every rank): its adapters in ``adapter`` mode, else its merged
    HF weights."""
    rec = lora_record(model)
    if not rec or rec["mode"] != "adapter":
        yield from model.named_hf_weights()
        return
    scale = float(rec["config"]["alpha"]) / float(rec["config"]["rank"])
    for name, t in model.bridge.export_adapter_weights(model.model, cpu=True, show_progress=False):
        yield name, (t * scale if name.endswith(".lora_B.weight") else t)


# -- adapters by a PEFT directory: SGLang's LoRA (/load_lora_adapter), and the reference engine's same call

ADAPTER_LINK = "adapter"  # RUN_DIR/lora/adapter: the newest version's directory, swapped in by rename


def adapter_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    """The adapters of ``model`` as megatron-bridge exports them (HF module names, ``…lora_A.weight``,
    ``…lora_B.weight``; B not scaled: the PEFT config's lora_alpha / r scales it). Collective, every rank."""
    yield from model.bridge.export_adapter_weights(model.model, cpu=True, show_progress=False)


def peft_adapter_config(rec: dict, names: list[str], base_path: str) -> dict:
    """PEFT's ``adapter_config.json`` for the adapters ``names`` of a LoRA record: its target modules are the HF
    module names the tensors carry (``q_proj``, ``lm_head``, ...)."""
    cfg = rec["config"]
    targets = sorted({n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in names})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
            "r": cfg["rank"], "lora_alpha": cfg["alpha"], "lora_dropout": cfg["dropout"], "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
            "modules_to_save": None}


def write_peft_dir(named: list[tuple[str, Any]], rec: dict, base_path: str, out: Path) -> int:
    """``named`` (:func:`adapter_tensors`) as a PEFT adapter directory at ``out`` (``adapter_config.json``,
    ``adapter_model.safetensors`` with PEFT's keys ``base_model.model.<module>.lora_A.weight``), written beside it
    and renamed: whole or absent. The tensors' bytes."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # a copy each: the bridge hands a fused linear's shared A (q, k, v; gate, up) as one tensor, which safetensors
    # refuses to save twice
    tensors = {"base_model.model." + n: t.detach().to("cpu").clone().contiguous() for n, t in named}
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(peft_adapter_config(rec, [n for n, _ in named], base_path),
                                                        indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AdapterDirSync:
    """Rank 0's adapter sync for engines that load LoRA adapters as SGLang does (``train.lora.mode: adapter`` with
    SGLang engines): each version is a PEFT directory under ``root`` (the run's directory, on the filesystem the
    engines share), ``root/adapter`` a link to the newest; every engine then swaps its adapter named
    :data:`~relax_hpc.engines.lora.LORA_NAME`: ``/unload_lora_adapter`` (SGLang waits for the requests using it),
    ``/load_lora_adapter`` from the link, ``/update_weight_version``.

    The link is swapped before any engine unloads: a request that names the adapter between an engine's unload and
    load makes SGLang load it again from the path it last loaded (its ``lora_ref_cache``), which is the link, so it
    gets the new version too, and the explicit load then answers "already loaded" (taken as done)."""

    KEEP = 2  # version directories kept: the newest, and the one before (an engine may still be reading it)

    def __init__(self, root: Path, api_key: str | None, base_path: str, *, timeout: float = 600.0):
        self.root, self.api_key, self.base_path, self.timeout = Path(root), api_key, base_path, timeout
        self._clients: dict[str, Any] = {}

    def write(self, version: str, named: list[tuple[str, Any]], rec: dict) -> int:
        """Version ``version``'s directory and the link to it; the adapter bytes written."""
        self.root.mkdir(parents=True, exist_ok=True)
        d = self.root / f"v{version}"
        nbytes = write_peft_dir(named, rec, self.base_path, d)
        link = self.root / ADAPTER_LINK
        tmp = self.root / (ADAPTER_LINK + ".tmp")
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(d.name)  # relative: the same link on every node that mounts the run directory
        os.replace(tmp, link)  # atomic: a reader sees the old version or the new, whole
        versions = sorted((p for p in self.root.glob("v*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
        for old in versions[: -self.KEEP]:
            if old != d:
                shutil.rmtree(old, ignore_errors=True)
        return nbytes

    def swap(self, url: str, version: str | None) -> None:
        """Engine ``url`` serves the newest adapter as :data:`LORA_NAME`, reporting ``version`` (None: the version
        it reports stays); raises
        :class:`~relax_hpc.engines.client.EngineError` (``status`` None: the engine did not answer)."""
        from relax_hpc.engines.client import EngineClient, EngineError
        from relax_hpc.engines.lora import LORA_NAME

        c = self._clients.get(url) or self._clients.setdefault(url, EngineClient(url, api_key=self.api_key,
                                                                                   timeout=self.timeout))
        # not loaded (the first sync, a restarted engine) is answered 400: nothing to unload, go on
        c.request("POST", "/unload_lora_adapter", {"lora_name": LORA_NAME}, ok_statuses=(200, 400))
        r = c.request("POST", "/load_lora_adapter",
                      {"lora_name": LORA_NAME, "lora_path": str(self.root / ADAPTER_LINK)}, ok_statuses=(200, 400))
        d = r.json() if r.content else {}
        why = str(d.get("error_message") or d.get("message") or r.text[:500])
        if not d.get("success") and "already loaded" not in why:  # already: loaded again from the link meanwhile
            raise EngineError(url, "/load_lora_adapter", f"HTTP {r.status_code}: {why}", status=r.status_code,
                              body=r.text)
        if version is not None:
            c.update_weight_version(version)

    def publish(self, version: str, named: list[tuple[str, Any]], rec: dict,
                engines: dict[str, str]) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
        """Write ``version`` and swap it on every engine: (metrics, {engine: version}, {engine: why} of the engines
        that did not answer). An engine that answers but refuses fails the sync (:class:`WeightSyncError`)."""
        from relax_hpc.engines.client import EngineError
        from relax_hpc.weights.sync import WeightSyncError

        t0 = time.monotonic()
        nbytes = self.write(version, named, rec)
        versions: dict[str, str] = {}
        dead: dict[str, str] = {}
        for name, url in engines.items():
            try:
                self.swap(url, version)
            except EngineError as e:
                if e.status is None:  # gone: the controller leaves it out, as a weight push does
                    dead[name] = str(e)
                    continue
                raise WeightSyncError(f"engine {name} ({url}) did not take LoRA adapter version {version}: {e}. "
                                      "Fix: start SGLang with train.lora's flags (--enable-lora, --max-lora-rank, "
                                      "--lora-target-modules: the engine role adds them) and give it the run "
                                      "directory on a filesystem it can read", [url]) from e
            versions[name] = version
        took = time.monotonic() - t0
        metrics = {"perf/weight_sync_bytes": float(nbytes), "perf/weight_sync_tensors": float(len(named)),
                   "perf/weight_sync_time": took, "perf/update_weights_time": took}
        return metrics, versions, dead

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients = {}
