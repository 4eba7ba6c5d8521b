"""A GPU check both kernel test files run on their mixture-of-experts weights: the fused batch-1 path
(ops.moe_mlp's three launches) chooses the grouped path's experts and gives its result to float32
rounding, token after token through the same scratch (the router's done counter and the tiles carry
nothing from one launch to the next). Not bit for bit: the fused router's logits sum each row's chunks
over four warps (qmvs), the grouped one's over one (qmvn)."""

from __future__ import annotations

import numpy as np

from ember.kernels import ops


def assert_fused_batch1_is_grouped(dev, w: ops.MoeWeights, xs: np.ndarray, *, k: int, apart: bool, **moe) -> None:
    """xs: tokens [t, hidden], each run alone (n = 1) through one scratch fused, through another grouped;
    moe: moe_mlp's act, gating and norm_topk."""
    hidden, ffn, E = w.router.cols, w.ffn, w.experts
    fused, grouped = (ops.MoeScratch.alloc(dev, 1, E, k, hidden, ffn, apart=apart) for _ in range(2))
    res = np.linspace(-1, 1, hidden, dtype=np.float32)
    for i, x in enumerate(xs):
        out, ids = [], []
        for s, on in ((fused, True), (grouped, False)):
            y = dev.empty((1, hidden))
            y.poison()
            ops.moe_mlp(dev, w, dev.to_device(x[None]), y, s, n=1, k=k, res=dev.to_device(res), fused=on, **moe)
            out.append(y.to_host()[0].astype(np.float64) - res)
            ids.append(s.ids.to_host()[:k])
        assert np.isfinite(out[0]).all(), f"token {i}: unwritten rows"
        np.testing.assert_array_equal(ids[0], ids[1], err_msg=f"token {i}: the experts chosen")
        err = np.linalg.norm(out[0] - out[1]) / np.linalg.norm(out[1])
        assert err < 1e-6, f"token {i}: relative difference {err:.2e}"
    assert int(fused.done.to_host()[0]) == 0
