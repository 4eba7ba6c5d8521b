"""The launchers DeepSeek V4's CUDA step calls (worker/backends/cuda/hyper_step.py), each as its kernel computes,
in numpy, over device arrays that are numpy buffers: the step's host code (its buffers, views, offsets, row
strides, the key lists it plans, the order of its kernels) then runs on the CPU end to end and its logits
can be compared with the numpy backend's. What it checks is the composition; each kernel's own agreement
with its twin is the GPU tests' (tests/test_kernels_hyper_gpu.py, test_kernels_gpu.py).

A launch computes at once here, but on a GPU it is queued on the backend's non-blocking stream, and a copy
to or from the host (to_host, upload) runs on the legacy stream, which does not wait for it: so a launch
leaves its stream pending until EmuStream.synchronize() (or the synchronize() of an event recorded after
it), and a host copy while it is pending fails, as it would read a result not yet there (or overwrite an
input still to be read) on the device. The asynchronous copies (upload_from, download_into: pinned memory,
ordered on the stream) run at once too, which is their place in the stream's order, since every launch
before them has computed already."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from gguf.constants import GGMLQuantizationType

from ember.kernels import ops as real_ops
from ember.kernels import quants, reference
from ember.kernels.ops.quant_matrix import row_nbytes

_QUEUED = [0]  # launches queued so far
_DONE = [0]  # of which the host knows to be done (a synchronize of the stream, or of an event after them)


def _host_copy(what: str) -> None:
    if _QUEUED[0] > _DONE[0]:
        raise AssertionError(f"{what} while {_QUEUED[0] - _DONE[0]} launches are queued: the stream is not "
                             "synchronized (host copies run on the legacy stream, which does not wait for it)")


class EmuStream:
    """The backend's stream: synchronize() is where the host may read what the launches wrote."""

    handle = 0

    def synchronize(self) -> None:
        _DONE[0] = _QUEUED[0]


class EmuEvent:
    """A point in the stream's work: synchronize() makes the launches before its record() done."""

    at = 0

    def record(self, stream=None) -> None:
        self.at = _QUEUED[0]

    def synchronize(self) -> None:
        _DONE[0] = max(_DONE[0], self.at)


class EmuHostBuffer:
    """Pinned host memory: a uint8 array."""

    def __init__(self, nbytes: int):
        self.nbytes = max(int(nbytes), 8)
        self.array = np.zeros(self.nbytes, np.uint8)

    def free(self) -> None:
        self.array = np.zeros(0, np.uint8)


class EmuArray:
    """A device allocation or a view into one: a flat numpy buffer and an element offset."""

    def __init__(self, base: np.ndarray, offset: int, shape, dtype=None):
        self.base, self.offset = base, int(offset)
        self.shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype or base.dtype)
        assert self.dtype == base.dtype, "views keep their allocation's type here"
        self.ptr = 1 << 40 | self.offset * self.dtype.itemsize  # 16-byte aligned where the offset is
        self.nbytes = self.size * self.dtype.itemsize
        assert self.offset + self.size <= base.size, "view exceeds the array"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def a(self) -> np.ndarray:
        """The view's elements (flat), writable in place."""
        return self.base[self.offset : self.offset + self.size]

    def rest(self) -> np.ndarray:
        """Everything from the view's start to its allocation's end (a kernel may read past a view's size)."""
        return self.base[self.offset :]

    def view(self, offset_elements: int, shape, dtype=None) -> EmuArray:
        dt = np.dtype(dtype or self.dtype)
        if dt == self.dtype:
            return EmuArray(self.base, self.offset + offset_elements, shape, dtype)
        # another type over the same bytes (an arena of a step's inputs): the allocation seen as that type
        at = (self.offset + offset_elements) * self.dtype.itemsize
        assert at % dt.itemsize == 0, "a view's start must be aligned for its type"
        raw = self.base.view(np.uint8)
        return EmuArray(raw[: raw.size // dt.itemsize * dt.itemsize].view(dt), at // dt.itemsize, shape, dt)

    def upload(self, arr) -> None:
        _host_copy("an upload")
        self.a[:] = np.asarray(arr).reshape(-1)

    def to_host(self) -> np.ndarray:
        _host_copy("a read on the host")
        return self.a.copy().reshape(self.shape)

    def upload_from(self, host: EmuHostBuffer, nbytes: int, stream, host_offset: int = 0) -> None:
        assert nbytes <= self.nbytes and host_offset + nbytes <= host.nbytes, "copy exceeds a buffer"
        self.a.view(np.uint8)[:nbytes] = host.array[host_offset : host_offset + nbytes]

    def download_into(self, host: EmuHostBuffer, nbytes: int, stream, host_offset: int = 0) -> None:
        assert nbytes <= self.nbytes and host_offset + nbytes <= host.nbytes, "copy exceeds a buffer"
        host.array[host_offset : host_offset + nbytes] = self.a.view(np.uint8)[:nbytes]

    def copy_from(self, src: EmuArray, nbytes: int, stream) -> None:
        n = nbytes // self.dtype.itemsize
        self.a[:n] = src.a[:n]

    def zero(self) -> None:
        self.a[:] = 0

    def poison(self) -> None:
        self.a[:] = np.nan if self.dtype.kind == "f" else -1


class EmuDevice:
    def __init__(self):
        self.caps = SimpleNamespace(pdl=False, clusters=False, smem_optin=227 << 10, integrated=False)
        self.sm_count = 132
        self.scratched: dict[str, int] = {}

    def empty(self, shape, dtype=np.float32) -> EmuArray:
        n = int(np.prod(shape))
        # floats start as NaN: a kernel that reads what nothing wrote shows in the logits
        base = np.full(n, np.nan, dtype) if np.dtype(dtype).kind == "f" else np.full(n, 7, dtype)
        return EmuArray(base, 0, shape)

    def to_device(self, arr) -> EmuArray:
        arr = np.ascontiguousarray(arr)
        return EmuArray(arr.reshape(-1).copy(), 0, arr.shape)

    def scratch(self, key: str, nbytes: int) -> EmuArray:
        self.scratched[key] = max(nbytes, self.scratched.get(key, 0))  # the largest each was asked for
        return self.empty((nbytes,), np.uint8)

    def pinned(self, nbytes: int) -> EmuHostBuffer:
        return EmuHostBuffer(nbytes)

    def event(self) -> EmuEvent:
        return EmuEvent()

    def make_current(self) -> None:
        pass


class EmuGraph:
    """A captured step: what a CUDA graph replays, the same launches with the same arguments over the same
    buffers, is here the same call of the step's forward pass (HyperStep._capture's stand-in: it runs
    nothing at capture, as a capture computes nothing)."""

    def __init__(self, forward):
        self.forward = forward

    def launch(self) -> None:
        self.forward()


def dense(m: real_ops.QuantMatrix) -> np.ndarray:
    """A matrix as the kernels decode it: its rows at their stride, each row's blocks (no Q6_K here: its
    device blocks are repacked)."""
    assert m.type != "q6_kp"
    natural = row_nbytes(m.type, m.cols)
    raw = m.data.a.reshape(m.rows, m.row_bytes)[:, :natural]
    return np.asarray(quants.dequantize(np.ascontiguousarray(raw).reshape(-1), GGMLQuantizationType[m.type.upper()],
                                        (m.rows, m.cols)), np.float32)


def _rows(x: EmuArray, n: int, cols: int, ld: int | None = None) -> np.ndarray:
    ld = cols if ld is None else ld
    return x.rest()[: (n - 1) * ld + cols].reshape(-1)[np.arange(n)[:, None] * ld + np.arange(cols)[None, :]] if n \
        else np.zeros((0, cols), np.float32)


def _put(y: EmuArray, n: int, cols: int, ld: int | None, v: np.ndarray) -> None:
    ld = cols if ld is None else ld
    if n:
        y.rest()[np.arange(n)[:, None] * ld + np.arange(cols)[None, :]] = v


def _half(x: np.ndarray) -> np.ndarray:
    """The tensor cores' inputs: rounded to float16, summed in float32."""
    return x.astype(np.float16).astype(np.float32)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class EmuOps:
    """Stands in for `ops` in hyper_step.py and matmul.py: the launchers the step calls, computed in numpy;
    every other name is the real module's."""

    def __getattr__(self, name):
        return getattr(real_ops, name)

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name not in _LAUNCHERS:
            return attr

        def launch(*args, **kwargs):  # queued on the stream, as on the device
            _QUEUED[0] += 1
            return attr(*args, **kwargs)

        return launch

    # -- matmuls ---------------------------------------------------------------------------------

    @staticmethod
    def matvec(dev, w, x, y, *, n=None, res=None, variant="auto", split=False, stream=None, **_):
        out = _rows(x, n, w.cols) @ dense(w).T
        if res is not None:
            out = out + _rows(res, n, w.rows)
        _put(y, n, w.rows, None, out)

    @staticmethod
    def matvec_fan(dev, w, x, outs, *, rows, stream=None):
        assert real_ops.matvec_fan_supported(dev, w, rows)
        out = _rows(x, 1, w.cols) @ dense(w).T
        for y, lo, hi in zip(outs, np.cumsum([0, *rows[:-1]]), np.cumsum(rows), strict=True):
            _put(y, 1, hi - lo, None, out[:, lo:hi])

    @staticmethod
    def matvec_groups(dev, w, x, y, *, groups, stream=None):
        assert real_ops.matvec_groups_supported(w, groups)
        rank = w.rows // groups
        W = dense(w).reshape(groups, rank, w.cols)
        _put(y, groups, rank, None, np.einsum("gc,grc->gr", _rows(x, groups, w.cols), W))

    @staticmethod
    def linear_tc(dev, w, x, y, *, n, res=None, kind="f16", scratch="gemm", stream=None):
        assert kind == "f16"
        # the matrix's kept 16-bit copy where it has one (QuantMatrix.keep_half), as the real launcher reads it
        kept = w.half is not None and w.half_kind == kind
        wh = w.half.a.view(np.float16).astype(np.float32).reshape(w.rows, w.cols) if kept else _half(dense(w))
        out = _half(_rows(x, n, w.cols)) @ wh.T
        if res is not None:
            out = out + _rows(res, n, w.rows)
        _put(y, n, w.rows, None, out)

    @staticmethod
    def dequant_half(dev, w, out, *, kind="f16", stream=None):
        assert kind == "f16" and out.dtype == np.uint16 and out.size == w.rows * w.cols
        out.a[:] = dense(w).astype(np.float16).view(np.uint16).reshape(-1)

    @staticmethod
    def matvec_rows(dev, w, x, y, *, n, stream=None):
        _put(y, n, w.rows, None, _rows(x, n, w.cols) @ dense(w).T)

    # -- the streams ----------------------------------------------------------------------------

    @staticmethod
    def embed(dev, w, out, ids, *, n, scale=1.0, feed=None, norm=None, stream=None):
        if feed is not None:  # the rows fed from the step before's draws take their token (stored, as the kernel)
            drawn, source = feed
            fed = source.a[:n] >= 0
            ids.a[:n][fed] = drawn.a[source.a[:n][fed]]
        _put(out, n, w.cols, None, dense(w)[ids.a[:n]] * np.float32(scale))

    @staticmethod
    def gather_rows(dev, x, idx, out, *, n, cols, ldx=None, stream=None):
        ldx = cols if ldx is None else ldx
        rows = idx.a[:n].astype(np.int64)
        _put(out, n, cols, None, x.rest()[rows[:, None] * ldx + np.arange(cols)[None, :]])

    @staticmethod
    def hc_pre(dev, x, raw, scale, base, y, post, comb, *, n, hc, hidden, eps, hc_eps, iters, ldr=None, stream=None):
        head = post is None
        m = hc if head else (2 + hc) * hc
        ldr = m if ldr is None else ldr
        xs = _rows(x, n, hc * hidden).reshape(n, hc, hidden)
        inv = 1.0 / np.sqrt((xs.reshape(n, -1) ** 2).mean(axis=1) + np.float32(eps))
        mix = _rows(raw, n, m, ldr) * inv[:, None]
        s, b = scale.a, base.a
        pre = _sigmoid(mix[:, :hc] * s[0] + b[:hc]) + np.float32(hc_eps)
        _put(y, n, hidden, None, np.einsum("nse,ns->ne", xs, pre))
        if head:
            return
        _put(post, n, hc, None, 2.0 * _sigmoid(mix[:, hc : 2 * hc] * s[1] + b[hc : 2 * hc]))
        c = (mix[:, 2 * hc :] * s[2] + b[2 * hc :]).reshape(n, hc, hc)
        c = reference.softmax(c, axis=2) + np.float32(hc_eps)
        c = c / (c.sum(axis=1, keepdims=True) + np.float32(hc_eps))
        for _ in range(1, iters):
            c = c / (c.sum(axis=2, keepdims=True) + np.float32(hc_eps))
            c = c / (c.sum(axis=1, keepdims=True) + np.float32(hc_eps))
        _put(comb, n, hc * hc, None, c.reshape(n, -1))

    @staticmethod
    def hc_logits(dev, x, fn, out, *, n, ldo=None, stream=None):
        assert fn.type == "f32"
        _put(out, n, fn.rows, ldo, _rows(x, n, fn.cols) @ dense(fn).T)

    @staticmethod
    def hc_mix(dev, x, fn, scale, base, y, post, comb, work, *, n, hc, hidden, eps, hc_eps, iters, stream=None):
        assert real_ops.hc_mix_supported(fn, n=n, hc=hc, hidden=hidden) and n <= work.rows
        raw = dev.empty((n * fn.rows,))
        raw.a[:] = (_rows(x, n, fn.cols) @ dense(fn).T).reshape(-1)
        EmuOps.hc_pre(dev, x, raw, scale, base, y, post, comb, n=n, hc=hc, hidden=hidden, eps=eps,
                      hc_eps=hc_eps, iters=iters)

    @staticmethod
    def hc_merge(dev, x, y, post, comb, *, n, hc, hidden, stream=None):
        xs = _rows(x, n, hc * hidden).reshape(n, hc, hidden)
        p, c = _rows(post, n, hc), _rows(comb, n, hc * hc).reshape(n, hc, hc)
        out = p[:, :, None] * _rows(y, n, hidden)[:, None, :] + np.einsum("nse,nsd->nde", xs, c)
        _put(x, n, hc * hidden, None, out.reshape(n, -1))

    @staticmethod
    def rms_norm(dev, x, weight, y, *, eps, rows, cols, heads=1, ldx=None, ldy=None, stream=None, **_):
        ldx = cols * heads if ldx is None else ldx
        ldy = cols * heads if ldy is None else ldy
        r = np.arange(rows)
        src = (r // heads * ldx + r % heads * cols)[:, None] + np.arange(cols)[None, :]
        dst = (r // heads * ldy + r % heads * cols)[:, None] + np.arange(cols)[None, :]
        y.rest()[dst] = reference.rms_norm(x.rest()[src], weight.a[:cols], eps)

    @staticmethod
    def rope(dev, q, k, pos, inv_freq, *, n, hq, hk, head_dim, neox, ldq=None, ldk=None, mscale=1.0,
             head_stride=None, inverse=False, stream=None):
        assert k is None and not neox
        hs = head_dim if head_stride is None else head_stride
        ldq = hq * hs if ldq is None else ldq
        theta = pos.a[:n].astype(np.float32)[:, None] * inv_freq.a[None, : head_dim // 2]
        cos, sin = np.cos(theta), np.sin(theta) * (-1 if inverse else 1)
        for h in range(hq):
            at = (np.arange(n) * ldq + h * hs)[:, None]
            i0, i1 = at + np.arange(0, head_dim, 2)[None, :], at + np.arange(1, head_dim, 2)[None, :]
            x0, x1 = q.rest()[i0].copy(), q.rest()[i1].copy()
            q.rest()[i0], q.rest()[i1] = x0 * cos - x1 * sin, x0 * sin + x1 * cos

    @staticmethod
    def store_rows(dev, src, idx, dst, *, n, width, lds, ldd, ape=None, stream=None):
        v = _rows(src, n, width, lds)
        if ape is not None:
            table, p, ratio = ape
            v = v + table.a.reshape(ratio, width)[p.a[:n] % ratio]
        rows = idx.a[:n].astype(np.int64)
        dst.rest()[rows[:, None] * ldd + np.arange(width)[None, :]] = v

    @staticmethod
    def mean_streams(dev, x, out, *, n, hc, hidden, ldo=None, stream=None):
        _put(out, n, hidden, ldo, _rows(x, n, hc * hidden).reshape(n, hc, hidden).mean(axis=1))

    @staticmethod
    def round_half(dev, x, *, n, stream=None):
        x.a[:n] = x.a[:n].astype(np.float16).astype(np.float32)

    @staticmethod
    def swap_rows(dev, src, dst, *, a, b, width, stream=None):
        dst.a[: a * b * width] = src.a[: a * b * width].reshape(a, b, width).swapaxes(0, 1).reshape(-1)

    @staticmethod
    def clamped_swiglu(dev, g, u, out, *, n, ffn, limit, ldg=None, ldu=None, ldo=None, stream=None):
        from ember.worker.backends.numpy.hyper import clamped_swiglu

        _put(out, n, ffn, ldo, clamped_swiglu(_rows(g, n, ffn, ldg), _rows(u, n, ffn, ldu), limit))

    # -- attention over key lists -----------------------------------------------------------------

    @staticmethod
    def compress_rows(dev, kv, score, rows, starts, out, *, ld, blocks, ratio, width, overlap, ldo=None,
                      stream=None):
        from ember.worker.backends.numpy.hyper import compress

        ldo = width if ldo is None else ldo
        cw = 2 * width if overlap else width
        got = []
        for own, prev in starts.a[: 2 * blocks].reshape(-1, 2):
            # the twin over this block alone, or over the block before and this one (its second row)
            parts = [prev, own] if overlap and prev >= 0 else [own]
            prow = np.concatenate([rows.a[p : p + ratio] for p in parts]).astype(np.int64)
            v = kv.rest()[prow[:, None] * ld + np.arange(cw)[None, :]]
            s = score.rest()[prow[:, None] * ld + np.arange(cw)[None, :]]
            got.append(compress(v, s, ratio, len(parts), overlap)[-1])
        if blocks:
            _put(out, blocks, width, ldo, np.stack(got))

    @staticmethod
    def indexer_scores(dev, q, w, keys, crow, ccnt, score, *, n, heads, dim, ld, ldc, stream=None):
        from ember.worker.backends.numpy.hyper import indexer_scores

        for t in range(n):
            c = int(ccnt.a[t])
            rows = crow.a[t * ldc : t * ldc + c].astype(np.int64)
            k = keys.rest()[rows[:, None] * ld + np.arange(dim)[None, :]]
            qt = q.a[t * heads * dim : (t + 1) * heads * dim].reshape(1, heads, dim)
            score.a[t * ldc : t * ldc + c] = indexer_scores(qt, w.a[t * heads : (t + 1) * heads][None], k)[0]

    @staticmethod
    def sample(dev, logits, params, out, *, rows, vocab, ld=None, out_floor=None, work=None, greedy=None,
               stream=None):
        from ember.kernels.ops.sampling import SampleParams
        from ember.kernels.reference import sample_rows

        raw, off = params.a.view(np.uint8), SampleParams.offsets(rows)
        field = {name: raw[off[name] : off[name] + rows * np.dtype(dt).itemsize].view(dt)
                 for name, dt in SampleParams.FIELDS}
        x = _rows(logits, rows, vocab, ld)
        tokens, floors = sample_rows(x, field["temperature"], field["top_k"], field["top_p"], field["min_p"],
                                     field["seed"], field["step"])
        out.a[:rows] = tokens
        if out_floor is not None:
            out_floor.a[:rows] = floors

    @staticmethod
    def top_k_rows(dev, score, crow, ccnt, idx, cnt, *, n, k, ldc, ldi, stream=None):
        for t in range(n):
            c, at = int(ccnt.a[t]), int(cnt.a[t])
            s = score.a[t * ldc : t * ldc + c]
            best = np.argsort(-s, kind="stable")[: min(k, c)]
            idx.a[t * ldi + at : t * ldi + at + len(best)] = crow.a[t * ldc : t * ldc + c][best]
            cnt.a[t] = at + len(best)

    @staticmethod
    def attend_rows(dev, q, keys, idx, cnt, sinks, out, *, n, heads, head_dim, ld, ldi, splits=None, stream=None):
        from ember.worker.backends.numpy.hyper import attend

        for t in range(n):
            rows = idx.a[t * ldi : t * ldi + int(cnt.a[t])].astype(np.int64)
            rows = rows[rows >= 0]
            k = keys.rest()[rows[:, None] * ld + np.arange(head_dim)[None, :]]
            qt = q.a[t * heads * head_dim : (t + 1) * heads * head_dim].reshape(1, heads, head_dim)
            o = attend(qt, k, np.ones((1, len(rows)), bool), sinks.a[:heads])
            out.a[t * heads * head_dim : (t + 1) * heads * head_dim] = o.reshape(-1)

    # -- experts ----------------------------------------------------------------------------------

    @staticmethod
    def moe_route_group(dev, logits, s, *, n, experts, k, gating, norm_topk, tile, bias=None, scale=1.0,
                        hashed=None, stream=None):
        chosen = None
        if hashed is not None:
            table, tokens = hashed
            chosen = table.a.reshape(-1, k)[tokens.a[:n]]
        ids, wts = reference.route(_rows(logits, n, experts), k=k, gating=gating, norm_topk=norm_topk,
                                   select_bias=None if bias is None else bias.a[:experts], scale=scale, chosen=chosen)
        pairs = n * k
        flat = ids.reshape(-1)
        order = np.argsort(flat, kind="stable")
        s.ids.a[:pairs], s.wts.a[:pairs], s.order.a[:pairs] = flat, wts.reshape(-1), order
        s.pos.a[:pairs][order] = np.arange(pairs)
        tiles, at = [], 0
        for e in range(experts):
            cnt = int((flat == e).sum())
            for r0 in range(at, at + cnt, tile):
                tiles.append((e, r0, min(tile, at + cnt - r0)))
            at += cnt
        s.tiles.a[: 3 * len(tiles)] = np.asarray(tiles, np.int32).reshape(-1)
        return len(tiles)

    @staticmethod
    def moe_gather(dev, x, s, *, n, k, hidden, stream=None):
        _put(s.xs, n * k, hidden, None, _rows(x, n, hidden)[s.order.a[: n * k] // k])

    @staticmethod
    def moe_matvec(dev, w, tiles, n_tiles, x, y, *, tile, act=None, x_per_pair=True, int8=False, stream=None):
        assert act is None
        rows, cols = w.rows, w.m.cols
        whole = dense(w.m).reshape(w.experts, rows, cols)
        for e, r0, nb in tiles.a[: 3 * n_tiles].reshape(-1, 3):
            xs = _rows(x.view(r0 * cols if x_per_pair else 0, nb * cols), nb, cols) if x_per_pair else \
                np.repeat(_rows(x, 1, cols), nb, axis=0)
            out = reference.linear_q8(xs, whole[e]).astype(np.float32) if int8 else xs @ whole[e].T
            _put(y.view(r0 * rows, nb * rows), nb, rows, None, out)

    @staticmethod
    def moe_gemm(dev, w, tiles, n_tiles, x, y, *, tile, half="f16", order=None, k=1, act=None, stream=None):
        assert act is None and half == "f16" and w.bias is None
        rows, cols = w.rows, w.m.cols
        whole = _half(dense(w.m)).reshape(w.experts, rows, cols)
        for e, r0, nb in tiles.a[: 3 * n_tiles].reshape(-1, 3):
            assert nb <= tile
            src = order.a[r0 : r0 + nb] // k if order is not None else np.arange(r0, r0 + nb)
            xs = _half(x.a[: x.size].reshape(-1, cols)[src])
            _put(y.view(r0 * rows, nb * rows), nb, rows, None, xs @ whole[e].T)

    @staticmethod
    def moe_combine(dev, s, y, *, n, k, hidden, res=None, stream=None):
        ys = _rows(s.ys, n * k, hidden)
        out = np.einsum("tk,tkh->th", _rows(s.wts, n, k), ys[s.pos.a[: n * k].reshape(n, k)])
        if res is not None:
            out = out + _rows(res, n, hidden)
        _put(y, n, hidden, None, out)


_LAUNCHERS = {name for name, v in vars(EmuOps).items() if isinstance(v, staticmethod)}
