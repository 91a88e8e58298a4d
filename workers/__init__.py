"""sluice workers: pull windowed batches from a model's Redis stream and run them."""
