"""gRPC served on the gateway's own event loop: HTTP/2 framing and the gRPC calls over it."""
