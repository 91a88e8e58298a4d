"""Model instances: the one contract every kind keeps (`model_instance`: capabilities,
`run(batch)`, `close`), the instance every tensor-function backend runs as (`stacked`: collate,
call, split), the instance of a generative model (`generative`), and a model's lanes, one thread per
instance (`lanes`). The factory that loads an instance of each kind is
`sluice.workers.backends.load_instance`.
"""
