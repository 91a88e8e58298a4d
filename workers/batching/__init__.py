"""One model's queue inside a worker: read its streams, hold what was read, batch it as
Triton's dynamic batcher would, launch each batch on a free instance and answer it.

`model_queue` wires the parts around one `QueueState` (`queue_state`), which they change only
through its named transitions: `reader` reads while there is room, `admission` validates and
queues, `pending` orders what waits, `batcher` decides (a pure function of the pending
requests and the time), `batch_loop` launches, `early_run` runs a quiet model's lone batch
ahead of its delay, and `answering` awaits each run and publishes it.
"""
