"""Triton's sequence batcher: the sequences a worker owns, their slots, batches and claims."""
