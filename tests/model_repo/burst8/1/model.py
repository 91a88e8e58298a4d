class Model:
    def __init__(self, context):
        pass

    def infer(self, inputs):
        return {"OUT": inputs["IN"] * 2}
