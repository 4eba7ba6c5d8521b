"""The CUDA backend (backend.py) and its parts: the forward pass built from the family's recipe, where a
family lands on the GPU (forward.py), the weights and each layer's variants (layers.py), the matmul
choices (matmul.py), one step's host-side plumbing (step.py), KV blocks to and from the host
(kv_blocks.py, kv.py) and the division of the device's memory (memory.py)."""
