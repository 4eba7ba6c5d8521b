"""The CUDA backend (backend.py) and its parts: the forward pass built from the family's recipe, where a
family lands on the GPU (forward.py), the weights and each layer's variants (layers.py), the matmul
choices (matmul.py), one step's host-side plumbing (step.py), KV blocks to and from the host
(kv_blocks.py, kv.py) and the division of the device's memory (memory.py). DeepSeek V4's stack
(recipe.Stack.HYPER) has a step of its own (hyper.py: its weights hyper_weights.py, its key lists
hyper_keys.py); open_backend() picks the one a model needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...model.config import ModelConfig
    from ...model.gguf_file import GGUFFile
    from .backend import CudaBackend
    from .hyper import CudaHyperBackend

# what the HYPER step takes of CudaBackend's settings (the others tune paths it does not have yet)
_HYPER_SETTINGS = ("n_blocks", "block_size", "device", "max_rows", "max_seqs", "gpu_mem", "tensor_cores",
                   "graphs", "mtp", "mtp_gguf", "dspark", "f16_weights")


def open_backend(config: ModelConfig, gguf_file: GGUFFile, **settings) -> CudaBackend | CudaHyperBackend:
    """The CUDA backend for a model: CudaHyperBackend for a HYPER stack (DeepSeek V4), else CudaBackend,
    with CudaBackend's keyword settings."""
    if config.hyper is not None:
        from .hyper import CudaHyperBackend

        return CudaHyperBackend(config, gguf_file, **{k: v for k, v in settings.items() if k in _HYPER_SETTINGS})
    from .backend import CudaBackend

    return CudaBackend(config, gguf_file, **settings)
