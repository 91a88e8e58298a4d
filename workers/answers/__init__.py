"""The way back: a batch's results, a decoupled model's streamed responses and an ensemble
step's hand-over to its next steps, written to Redis in one round trip with the batch's
acknowledgement (`publisher`), and the requests whose results Redis refused for memory
answered with an error instead (`refused_results`).
"""
