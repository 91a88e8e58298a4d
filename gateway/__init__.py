"""sluice gateway: the KServe v2 / Triton HTTP front door that queues requests on Redis."""
