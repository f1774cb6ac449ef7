"""recorder_server.py (SGLang's own HTTP application over a recording engine side) with SGLang's LoRA calls answered:
``/load_lora_adapter`` and ``/unload_lora_adapter`` are parsed by SGLang's routes into its ``io_struct`` classes and
recorded; the answers are SGLang's ``LoRAUpdateOutput``, with the messages its tokenizer manager and LoRA manager
give for a name loaded twice and a name not loaded (sglang/srt/lora/lora_manager.py, lora_registry.py). Same
arguments as recorder_server.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recorder_server as rs  # noqa: E402 - boot and sglang first, as that module does


async def load_lora_adapter(self, obj, request=None):
    from sglang.srt.managers.io_struct import LoRAUpdateOutput

    self._record("/load_lora_adapter", obj, request)
    loaded = self.__dict__.setdefault("loras", {})
    if obj.lora_name in loaded:
        return LoRAUpdateOutput(success=False, error_message=f"Failed to load LoRA adapter {obj.lora_name} because "
                                                             "it is already loaded")
    loaded[obj.lora_name] = obj.lora_path
    return LoRAUpdateOutput(success=True, loaded_adapters=dict(loaded))


async def unload_lora_adapter(self, obj, request=None):
    from sglang.srt.managers.io_struct import LoRAUpdateOutput

    self._record("/unload_lora_adapter", obj, request)
    loaded = self.__dict__.setdefault("loras", {})
    if obj.lora_name not in loaded:
        return LoRAUpdateOutput(success=False, error_message=f"LoRA with name {obj.lora_name} does not exist. "
                                                             f"Loaded LoRAs: {loaded.keys()}")
    del loaded[obj.lora_name]
    return LoRAUpdateOutput(success=True, loaded_adapters=dict(loaded))


rs.Recorder.load_lora_adapter = load_lora_adapter
rs.Recorder.unload_lora_adapter = unload_lora_adapter

if __name__ == "__main__":
    rs.main()
