"""Iterative (in-flight) batching of generative models: sequences join and leave a running
batch between steps (`inflight`, the scheduler), each instance steps its sequences
(`generation`), the queue's loop feeds the instances in place of the batch loop
(`inflight_loop`), and the statistics Triton reports for them (`generation_stats`). The
generative instances it steps are `sluice.workers.instances.generative`'s.
"""
