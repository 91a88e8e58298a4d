"""Nothing lost when a worker or a queue goes: a dead worker's pending entries are claimed,
split and run again or dead-lettered (`recovery`, the Redis side; `takeover`, the queue's
loop), and a queue that is replaced or unloaded drains (`retirement`) and puts what it had
read back on the stream for its successor (`handoff`).
"""
