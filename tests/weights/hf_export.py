"""The actor's export stand-in for the weight tests: an HF model's own parameter tensors under their HF names (every
rank holds every full tensor, as the bridge's export gives them; the next train updates them in place), nothing
handed over in place."""

from __future__ import annotations


class HFModel:
    def __init__(self, model):
        self.model = model

    def named_hf_weights(self):
        yield from self.model.state_dict().items()

    def in_place(self):
        return None
