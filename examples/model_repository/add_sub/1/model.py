"""A plain-Python sluice model: element-wise sum and difference of two vectors.

The contract: a class `Model`, built once per instance with a `ModelContext`
(name, version, paths, device, config), whose `infer` maps a dict of batched input
tensors to a dict of output tensors with the same leading batch dim.
"""

import torch


class Model:
    def __init__(self, context):
        self.device = context.device

    def infer(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
