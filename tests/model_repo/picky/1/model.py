class Model:
    """Fails any batch that holds the value 13, so one bad request meets good ones."""

    def __init__(self, context):
        pass

    def infer(self, inputs):
        if (inputs["IN"] == 13).any():
            raise ValueError("13 is unlucky")
        return {"OUT": inputs["IN"] * 10}
