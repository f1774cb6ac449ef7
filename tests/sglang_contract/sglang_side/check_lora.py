"""SGLang's own LoRA code reading what relax_hpc hands it in ``train.lora.mode: adapter``. Run by SGLang's interpreter:

    python check_lora.py launch OUT ARGS...     SGLang's prepare_server_args(ARGS) (its parser and its LoRA
                                                checks, check_lora_server_args); OUT gets the resolved LoRA fields.
                                                A refused flag exits 2 (the parser) or 1 (a check), with SGLang's
                                                message on stderr
    python check_lora.py peft OUT DIR BASE ARGS SGLang's LoRAConfig(DIR) and LoRAAdapter(...).initialize_weights()
                                                over base model BASE's config (its own PEFT loader, on the CPU;
                                                ARGS: the server's LoRA flags);
                                                OUT gets what it made of DIR: config, scaling, each layer's weights
                                                after its q/k/v and gate/up stacking, the lm_head/embedding weights
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import boot  # noqa: E402,F401 - before sglang


def launch(out, args):
    from sglang.srt.server_args import prepare_server_args

    a = prepare_server_args(args)
    try:  # the resolution and the checks, as SGLang's engine launch runs them (check_lora_server_args among them)
        a.resolve_once()
        a.check_server_args()
    except Exception as e:  # noqa: BLE001 - shown, exit 1
        sys.exit(f"SGLang refused the arguments: {type(e).__name__}: {e}")
    mods = a.lora_target_modules
    with open(out, "w") as f:
        json.dump({"enable_lora": a.enable_lora, "max_lora_rank": a.max_lora_rank,
                   "lora_target_modules": sorted(mods) if mods is not None else None,
                   "lora_paths": [str(p) for p in (a.lora_paths or [])]}, f)


def peft(out, path, base):
    from transformers import AutoConfig

    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig

    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    # the loader reads the server's arguments, as in an SGLang process (the LoRA flags relax_hpc launches with)
    publish(prepare_server_args(["--model-path", base, "--device", "cpu", *sys.argv[5:]]), role="scheduler")
    cfg = LoRAConfig(path)
    # no backend: initialize_weights only reads and stacks the tensors (the kernels are a GPU matter)
    adapter = LoRAAdapter("relax-lora", cfg, AutoConfig.from_pretrained(base), LoadConfig(), lora_backend=None)
    adapter.initialize_weights()
    layers = [{k: list(v.shape) for k, v in layer.weights.items()} for layer in adapter.layers]
    with open(out, "w") as f:
        json.dump({"r": cfg.r, "lora_alpha": cfg.lora_alpha, "target_modules": sorted(cfg.target_modules),
                   "scaling": adapter.scaling, "layers": layers,
                   "embedding": {k: list(v.shape) for k, v in adapter.embedding_layers.items()}}, f)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "launch":
        launch(out, sys.argv[3:])
    elif mode == "peft":
        peft(out, sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"check_lora.py: unknown mode {mode!r}")
