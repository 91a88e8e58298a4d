"""`sluice tune`: find the batching config that serves the most at a latency objective."""
