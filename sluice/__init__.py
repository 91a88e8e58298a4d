"""sluice: Triton-compatible dynamic batching over Redis streams."""

__version__ = "0.1.0"
