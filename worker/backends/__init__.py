"""The compute backends: the interface and its value types (base.py), the numpy reference (numpy/), the
CUDA backend (cuda/), and fault injection as a backend that wraps another (faults.py).

A backend runs a batch of sequence chunks over its paged KV pool and moves KV blocks to and from the
host; it knows nothing of requests, queues or scheduling (worker/engine/). Nothing here imports the
engine; the server wires a concrete backend to it.
"""
