"""What of a family's recipe the CUDA forward pass (forward.py) runs, declared as one table (`RUNS`), and
the one-line refusal of a model that needs anything else. layers.check_runs reads it at load, before
anything is allocated; the numpy backend runs every recipe, and the refusal says so.

A row turns on when forward.py and the kernels learn the feature (with a numpy twin and a gpu test);
nothing else in the backend decides whether a family runs. The activation codes the kernels take are
kernels/constants.py's ACTIVATIONS, so `acts` is read from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.kernels.constants import ACTIVATIONS, KERNEL_CONSTANTS

from ...model.arch.recipe import Act, Gating, Norms, Presence, Rope, Stack
from ...model.config import ModelConfig


@dataclass(frozen=True)
class CudaRuns:
    """The recipe features the CUDA forward pass runs (see the module docstring)."""

    stacks: frozenset[Stack]  # what a layer is built around
    norms: frozenset[Norms]
    qk_norm: bool  # rms_norm over each head of q and k (fused into the attention prologue)
    attn_bias: bool  # q, k and v biases
    attn_out_bias: bool  # the output projection's bias
    attn_sinks: bool  # a learned logit per head in each softmax's denominator
    sliding_window: bool  # windowed layers, with a RoPE base of their own
    ropes: frozenset[Rope]
    yarn: bool  # YaRN's frequencies and its cos/sin scale
    acts: frozenset[Act]  # the gated MLP's activation (dense and experts)
    gatings: frozenset[Gating]  # how a router's logits become the chosen experts' weights
    moe_biases: bool  # a router bias and each expert's gate, up and down biases
    moe_post_norms: bool  # a mixture of experts in a post-norm layer
    max_experts: int
    max_top_k: int


RUNS = CudaRuns(
    # HYPER (DeepSeek V4: hyper-connections, compressed CSA/HCA attention, hash-routed experts): not in this
    # forward; the worker runs it through hyper.py's own step (cuda/__init__.py open_backend picks it)
    stacks=frozenset({Stack.RESIDUAL}),
    norms=frozenset(Norms),
    qk_norm=True,
    attn_bias=True,
    attn_out_bias=True,
    attn_sinks=True,
    sliding_window=True,
    ropes=frozenset(Rope),
    yarn=True,
    acts=frozenset(Act(name) for name in ACTIVATIONS),
    gatings=frozenset({Gating.SOFTMAX, Gating.SOFTMAX_TOPK}),  # moe.cu GATING_*; not deepseek4's sqrt-softplus
    moe_biases=True,
    moe_post_norms=False,  # forward.py's MoE path adds into the residual without a post-norm
    max_experts=KERNEL_CONSTANTS["MOE_MAX_EXPERTS"],
    max_top_k=KERNEL_CONSTANTS["MOE_MAX_K"],
)

# what a stack the backend lacks brings, as its refusal names it
STACK_WORDS = {Stack.HYPER: "hyper-connections, compressed CSA/HCA attention, hash-routed experts"}


def refusal(config: ModelConfig, runs: CudaRuns | None = None) -> str | None:
    """Why the CUDA backend cannot run `config`'s recipe (against `runs`, default RUNS), in one line naming
    what it lacks and the backend that runs it, or None: the stack first, then the mixture of experts, then
    the layer's other parts."""
    runs = runs or RUNS
    r, arch = config.recipe, config.arch
    numpy = "--backend numpy runs"
    if r.stack not in runs.stacks:
        return (f"the cuda backend's batched forward does not run {arch} ({STACK_WORDS.get(r.stack, r.stack.value)}) "
                f"yet (the worker serves it on cuda through its own eager step, backends/cuda/hyper.py); {numpy} it")
    moe = r.moe
    if moe is not None and (moe.gating not in runs.gatings or r.act not in runs.acts
                            or (moe.biases and not runs.moe_biases) or (r.post_norms and not runs.moe_post_norms)
                            or config.n_experts > runs.max_experts or config.n_experts_used > runs.max_top_k):
        extras = "".join((", biases" if moe.biases and not runs.moe_biases else "",
                          ", post-norms" if r.post_norms and not runs.moe_post_norms else ""))
        return (f"the cuda backend does not run this mixture of experts ({arch}: {config.n_experts_used} of "
                f"{config.n_experts} experts, {moe.gating.value} gating, {r.act} experts{extras}) yet; {numpy} it")
    layer = (
        (f"{r.norms.value} norms", r.norms not in runs.norms),
        ("q/k norms", r.qk_norm and not runs.qk_norm),
        ("q/k/v biases", r.attn_bias is not Presence.NONE and not runs.attn_bias),
        ("output biases", r.attn_out_bias and not runs.attn_out_bias),
        ("attention sinks", r.attn_sinks and not runs.attn_sinks),
        ("sliding windows", config.sliding_window > 0 and not runs.sliding_window),
        (f"{r.rope.value} RoPE", r.rope not in runs.ropes),
        ("YaRN RoPE", config.rope_yarn is not None and not runs.yarn),
        (f"the {r.act} activation", moe is None and r.act not in runs.acts),
    )
    missing = [what for what, lacks in layer if lacks]
    if missing:
        return (f"the cuda backend does not run {', '.join(missing)} ({arch}) yet; "
                f"{numpy} {'them' if len(missing) > 1 else 'it'}")
    return None
