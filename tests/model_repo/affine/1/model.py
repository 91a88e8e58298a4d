"""y = 2x + 1, and fails any batch holding a 13, so bulk jobs meet a bad item among good ones."""


class Model:
    def __init__(self, context):
        pass

    def infer(self, inputs):
        if (inputs["X"] == 13).any():
            raise ValueError("13 is unlucky")
        return {"Y": inputs["X"] * 2 + 1}
