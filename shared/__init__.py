"""Code shared by the sluice gateway and workers: wire protocol, key names, model configs."""
