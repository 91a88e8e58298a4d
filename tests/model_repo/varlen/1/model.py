import torch


class Model:
    def __init__(self, context):
        pass

    def infer(self, inputs):
        return {"SUM": inputs["IN"].to(torch.int64).sum(dim=1, keepdim=True)}
