"""Which models a worker serves and when that changes: Triton's model control modes over the
repository's desired state in Redis or its files (`model_manager`), each load, reload and
unload carried out (`served_models`), a model's instances built from its files
(`model_build`), and a load's `file:` overrides kept in a private directory
(`override_files`).
"""
