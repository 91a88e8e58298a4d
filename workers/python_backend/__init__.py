"""Triton's Python backend inside a sluice worker: `model.py` files that define
`class TritonPythonModel` and import `triton_python_backend_utils` run unchanged.

`pb_utils` is the module those files import; `loading` imports a model file and builds its
instances (and auto-completes its config); `instance` runs one batch's requests through
`execute`; `iterative` steps an `iterative_sequence` model's requests through it, for
in-flight batching; `bls` sends a model's own infer requests through the fleet's streams.
"""
