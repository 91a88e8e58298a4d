"""KServe's gRPC messages under the module name their classes carry (`grpc_service_pb2`, as
tritonclient generates them), so that Ray Serve's gRPC proxy can pickle a request to its
replica and the replica unpickle it (serve_ray.py; this folder is on both's PYTHONPATH)."""

from tritonclient.grpc.service_pb2 import *  # noqa: F403
