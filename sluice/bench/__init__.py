"""`sluice bench`: a load generator for any KServe v2 HTTP endpoint (sluice or Triton).

The client side is kept cheap (raw keep-alive HTTP/1.1, request bytes encoded once) so that
on a small machine the numbers describe the server, and it reports its own CPU use to prove it.
"""
