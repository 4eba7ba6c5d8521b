"""The engine: the loop (loop.py) and the units whose decisions it applies, as vLLM v1 splits them.

The loop's step is plan, execute, settle. The scheduler plans which sequences a step computes
(scheduler.py); the KV manager answers for blocks, prefixes and the KV store (kv_manager.py,
kv_blocks.py); the output processor turns each step's logits or draws into text, stops and finish
reasons (output.py, with sampling, constraints, reasoning budgets, the loop guard and stop strings);
speculative decoding is spec/. The requests' queues (queues.py), run-ahead decoding (run_ahead.py),
failing alone (isolation.py) and what steps cost (cost_sampling.py) are units of their own. The
frontend reads what the engine publishes (stats.py). Backends are not here: worker/backends/ holds
the interface the engine drives, and the server wires a concrete one in.
"""
