"""q4_k (`tlm.interop.q4k`): llama.cpp's Q4_K rounding, held to a scalar port of
its reference loops, and its GGUF bytes to the `gguf` package's dequantization."""

import gguf
import numpy as np
import torch

from tlm.interop import q4k


def weights(rows: int = 6, inputs: int = 512) -> torch.Tensor:
    """Random rows with the blocks the rounding must get right: zeros, a constant, all
    positive (the min clamped to 0), one large outlier."""
    torch.manual_seed(0)
    W = torch.randn(rows, inputs) * 0.05
    W[0, :32] = 0
    W[1, 32:64] = 0.3
    W[2, :256] = torch.rand(256)
    W[3, 7] = 2.0
    return W


def test_gguf_reads_the_bytes_as_tlm_dequantizes():
    parts = q4k.quantize(weights())
    raw = q4k.to_gguf(*parts)
    assert raw.shape == (6, 2 * 144)
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(back, q4k.dequantize(*parts).numpy())


def test_the_rounding_is_llama_cpps():
    """Against `reference` (llama.cpp's loops, one value at a time, in fp32). tlm's sums run
    in another order (and in another on each vector width: torch's reductions), so a
    trial's weighted error, or d before its fp16 rounding, may differ in its last bits:
    d and dmin within one fp16 step, nearly every scale, min and level the same, and the
    weights as close to the originals as the reference's."""
    W = weights(16, 1024)
    q, sc, m, d, dmin = q4k.quantize(W)
    expected = [reference(row[i : i + q4k.SUPER].numpy()) for row in W for i in range(0, 1024, 256)]
    rq, rsc, rm, rd, rdmin = (np.stack([e[k] for e in expected]) for k in range(5))
    for mine, theirs in ((d, rd), (dmin, rdmin)):
        assert np.allclose(mine.float().numpy().ravel(), theirs, rtol=2**-10, atol=0)
    assert (sc.numpy().reshape(-1, 8) == rsc).mean() >= 0.99
    assert (m.numpy().reshape(-1, 8) == rm).mean() >= 0.99
    assert (q.numpy().reshape(-1, 256) == rq).mean() >= 0.995
    theirs = torch.from_numpy(q4k_dequantized(rq, rsc, rm, rd, rdmin)).view(W.shape)
    ours = q4k.dequantize(q, sc, m, d, dmin)
    assert (ours - W).square().sum() <= 1.02 * (theirs - W).square().sum()


def q4k_dequantized(q, sc, m, d, dmin) -> np.ndarray:
    """The reference's blocks as weights: d sc q - dmin m."""
    step = (np.float32(d)[:, None] * sc.astype(np.float32)).repeat(32, axis=1)
    shift = (np.float32(dmin)[:, None] * m.astype(np.float32)).repeat(32, axis=1)
    return step * q.astype(np.float32) - shift


def reference(x: np.ndarray):
    """quantize_row_q4_K_ref for one super-block, written as llama.cpp's C is: scalar fp32."""
    f = np.float32
    L = np.zeros(256, dtype=np.int64)
    scales, mins = np.zeros(8, dtype=f), np.zeros(8, dtype=f)
    for j in range(8):
        xs = x[32 * j : 32 * j + 32].astype(f)
        sum_x2 = f(0)
        for v in xs:
            sum_x2 = f(sum_x2 + v * v)
        av_x = f(np.sqrt(f(sum_x2 / f(32))))
        w = np.array([f(av_x + abs(v)) for v in xs], dtype=f)
        scales[j], mins[j], L[32 * j : 32 * j + 32] = qkx2(xs, w)
    max_scale, max_min = f(max(0, scales.max())), f(max(0, mins.max()))
    inv_scale = f(63) / max_scale if max_scale > 0 else f(0)
    inv_min = f(63) / max_min if max_min > 0 else f(0)
    sc = np.array([min(63, nearest(f(inv_scale * s))) for s in scales], dtype=np.uint8)
    mn = np.array([min(63, nearest(f(inv_min * v))) for v in mins], dtype=np.uint8)
    d, dmin = np.float16(max_scale / f(63)), np.float16(max_min / f(63))
    for j in range(8):
        dd = f(f(d) * f(sc[j]))
        if dd == 0:
            continue
        dm = f(f(dmin) * f(mn[j]))
        for i in range(32):
            L[32 * j + i] = max(0, min(15, nearest(f(f(x[32 * j + i] + dm) / dd))))
    return L.astype(np.uint8), sc, mn, float(d), float(dmin)


def qkx2(x: np.ndarray, w: np.ndarray):
    """make_qkx2_quants(32, 15, x, w, L, &min, Laux, -1, 0.1, 20, false): (scale, -min, L)."""
    f = np.float32
    lo, hi, sum_w, sum_x = x[0], x[0], w[0], f(w[0] * x[0])
    for i in range(1, 32):
        lo, hi = min(lo, x[i]), max(hi, x[i])
        sum_w, sum_x = f(sum_w + w[i]), f(sum_x + f(w[i] * x[i]))
    lo = min(lo, f(0))
    if hi == lo:
        return f(0), f(-lo), np.zeros(32, dtype=np.int64)
    iscale = f(f(15) / f(hi - lo))
    scale = f(f(1) / iscale)
    L = np.array([max(0, min(15, nearest(f(iscale * f(v - lo))))) for v in x])
    best = f(0)
    for i in range(32):
        diff = f(f(f(scale * f(L[i])) + lo) - x[i])
        best = f(best + f(w[i] * f(diff * diff)))
    for step in range(21):
        iscale = f(f(f(-1) + f(f(0.1) * f(step)) + f(15)) / f(hi - lo))
        aux = np.array([max(0, min(15, nearest(f(iscale * f(v - lo))))) for v in x])
        sum_l = sum_l2 = sum_xl = f(0)
        for i in range(32):
            wl = f(w[i] * f(aux[i]))
            sum_l, sum_l2 = f(sum_l + wl), f(sum_l2 + f(wl * f(aux[i])))
            sum_xl = f(sum_xl + f(wl * x[i]))
        D = f(f(sum_w * sum_l2) - f(sum_l * sum_l))
        if D > 0:
            this_scale = f(f(f(sum_w * sum_xl) - f(sum_x * sum_l)) / D)
            this_min = f(f(f(sum_l2 * sum_x) - f(sum_l * sum_xl)) / D)
            if this_min > 0:
                this_min, this_scale = f(0), f(sum_xl / sum_l2)
            error = f(0)
            for i in range(32):
                diff = f(f(f(this_scale * f(aux[i])) + this_min) - x[i])
                error = f(error + f(w[i] * f(diff * diff)))
            if error < best:
                L, best, scale, lo = aux, error, this_scale, this_min
    return scale, f(-lo), L


def nearest(v) -> int:
    return int(np.rint(v))  # half to even, as llama.cpp's nearest_int


def test_the_activations_are_llama_cpps_q8_k():
    """q4_k's activations (`q4._q8_k`) are quantize_row_q8_K_ref's, value for value: a
    super-block whose largest magnitude is negative, one that is all zeros, one whose values
    land on halves (rounded to even)."""
    from tlm.inference.formats import q4

    torch.manual_seed(2)
    x = torch.randn(3, 768) * 4
    x[1, 256:512] = 0
    x[2, :256] = torch.arange(256) / 2 - 63.5  # max |x| = 63.5 -> iscale = 2: halves stay
    x[2, 600] = -40.0
    xq, dx = q4._q8_k(x)
    f = np.float32
    for row, (got_q, got_d) in enumerate(zip(xq.view(3, -1, 256), dx[:, ::8], strict=True)):
        for s in range(3):
            block = x[row, 256 * s : 256 * s + 256].numpy()
            most = block[np.abs(block).argmax()]  # the first of the largest
            if most == 0:
                assert got_d[s] == 0 and not got_q[s].any()
                continue
            iscale = f(f(-127) / f(most))
            expected = [min(127, nearest(f(iscale * v))) for v in block]
            assert got_q[s].tolist() == expected
            assert got_d[s].item() == f(f(1) / iscale)
