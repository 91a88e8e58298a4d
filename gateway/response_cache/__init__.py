"""Triton's response cache, at the gateway: a hit is answered without queueing."""
