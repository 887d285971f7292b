"""Lane-level numpy emulation of decode attention's tensor-core key walk (attn_walk_mma in
csrc/decode_attention_walks.cuh), both forms: 16-key steps at head dims 64 and 128, and the 8-key
steps of head dim 256 with the values' product turned around (attn_mma_step_d256).

Checks the walk's index math without a GPU: the ring stage layout that cp.async writes (16-byte
chunks XOR-swizzled by row), the addresses each lane hands ldmatrix (plain and transposed), the
fragments of the m16n8k16 and m16n8k8 MMAs as the PTX ISA lays them out, the online softmax on the
score accumulators, and where each lane leaves its part of the output. The D <= 128 form runs on
GPUs (its tests pass there), so it vouches for this model of the instructions; the D = 256 form is
then checked against the same model. The MMAs sum in float64 here, not in the hardware's order.

    python -m bench.attn_walk_emulator
"""
from __future__ import annotations

import math

import numpy as np

LOG2E = 1.4426950408889634
HEADS = 4  # query heads per block (kAttnHeads)


def step_keys(dl: int) -> int:
    """attn_mma_keys"""
    return 16 if dl <= 4 else 8


# ---------------------------------------------------------------------------------------------
# The instructions, as the PTX ISA describes them. A 32-bit register is a pair of halves (lo, hi);
# a warp's register is an array [32, 2] of float16.

def fill_stage(k_rows: np.ndarray, v_rows: np.ndarray, j0: int, j_end: int, dl: int) -> np.ndarray:
    """One ring stage as attn_mma_issue writes it: the step's K rows, then its V rows, 16-byte
    chunk ch of row r at chunk position ch ^ (r & 7); rows at or past j_end zero (cp.async's
    zero fill). The stage as halves."""
    D, SK = 32 * dl, step_keys(dl)
    RC = D // 8
    stage = np.zeros(2 * SK * RC * 8, dtype=np.float16)
    for is_v, rows in ((0, k_rows), (1, v_rows)):
        for r in range(SK):
            j = j0 + r
            for ch in range(RC):
                at = is_v * SK * RC * 8 + (r * RC + (ch ^ (r & 7))) * 8
                stage[at:at + 8] = rows[j, ch * 8:(ch + 1) * 8] if j < j_end else 0
    return stage


def ldmatrix_x4(stage: np.ndarray, row_at: list[int], trans: bool) -> list[np.ndarray]:
    """Four 8x8 matrices; lane t gives the address (in halves) of row t % 8 of matrix t // 8.
    Register i of lane t: matrix i's row t // 4, columns 2 (t % 4) and + 1; transposed, its column
    t // 4, rows 2 (t % 4) and + 1."""
    mats = [np.stack([stage[row_at[8 * i + r]:row_at[8 * i + r] + 8] for r in range(8)]) for i in range(4)]
    regs = []
    for m in mats:
        reg = np.zeros((32, 2), dtype=np.float16)
        for t in range(32):
            g, c = t // 4, 2 * (t % 4)
            reg[t] = (m[c, g], m[c + 1, g]) if trans else (m[g, c], m[g, c + 1])
        regs.append(reg)
    return regs


def _frag_matrix(regs: list[np.ndarray], rows: int, cols: int, places) -> np.ndarray:
    """A matrix from fragments: places(i, t) -> (row, col) of register i's lo half on lane t (its
    hi half is the next column)."""
    out = np.zeros((rows, cols))
    for i, reg in enumerate(regs):
        for t in range(32):
            r, c = places(i, t)
            out[r, c], out[r, c + 1] = reg[t]
    return out


def _scatter_c(c: np.ndarray, d: np.ndarray) -> None:
    """C fragments [32, 4] from the 16x8 result d: c0, c1 row g, columns 2 cq, + 1; c2, c3 row g + 8."""
    for t in range(32):
        g, cq = t // 4, t % 4
        c[t] = (d[g, 2 * cq], d[g, 2 * cq + 1], d[g + 8, 2 * cq], d[g + 8, 2 * cq + 1])


def _gather_c(c: np.ndarray) -> np.ndarray:
    d = np.zeros((16, 8))
    for t in range(32):
        g, cq = t // 4, t % 4
        d[g, 2 * cq], d[g, 2 * cq + 1], d[g + 8, 2 * cq], d[g + 8, 2 * cq + 1] = c[t]
    return d


def mma_16816(c: np.ndarray, a: list[np.ndarray], b: list[np.ndarray]) -> None:
    """c [32, 4] += A B, A 16x16 from a0..a3 (rows g / g + 8, columns 2 cq / 2 cq + 8), B 16x8
    from b0, b1 (k rows 2 cq / 2 cq + 8, column g)."""
    A = _frag_matrix(a, 16, 16, lambda i, t: (t // 4 + 8 * (i & 1), 2 * (t % 4) + 8 * (i >> 1)))
    Bt = _frag_matrix(b, 8, 16, lambda i, t: (t // 4, 2 * (t % 4) + 8 * i))  # B transposed: [n, k]
    _scatter_c(c, _gather_c(c) + A @ Bt.T)


def mma_1688(c: np.ndarray, a: list[np.ndarray], b: np.ndarray) -> None:
    """c [32, 4] += A B, A 16x8 from a0, a1 (rows g / g + 8, columns 2 cq), B 8x8 from b0 (k rows
    2 cq, column g)."""
    A = _frag_matrix(a, 16, 8, lambda i, t: (t // 4 + 8 * i, 2 * (t % 4)))
    Bt = _frag_matrix([b], 8, 8, lambda i, t: (t // 4, 2 * (t % 4)))
    _scatter_c(c, _gather_c(c) + A @ Bt.T)


def xor_max(v: np.ndarray, s: int) -> np.ndarray:
    return np.maximum(v, v[np.arange(32) ^ s])


def half2(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return np.stack([lo, hi], axis=1).astype(np.float16)


def online_softmax(s: np.ndarray, mk: np.ndarray, m_run: np.ndarray, l_run: np.ndarray, qscale: float,
                   cap2: float | None):
    """One step's softmax update on the score accumulators s [32, keys per lane]: base-2 scores
    (capped), the head's max over the lanes of one g (xor 1, 2), the rescale alpha and the
    probabilities. Returns p, alpha, m_run, l_run (this lane's part of the head's sum)."""
    s = (cap2 * np.tanh(s * qscale / cap2) if cap2 else s * qscale) + mk
    mx = xor_max(xor_max(s.max(axis=1), 1), 2)
    m_new = np.maximum(m_run, mx)
    none = m_new == -np.inf  # every key so far masked for this head
    alpha = np.where(none, 1.0, np.exp2(m_run - np.where(none, 0, m_new)))
    p = np.where(none[:, None], 0.0, np.exp2(s - np.where(none, 0, m_new)[:, None]))
    return p, alpha, m_new, l_run * alpha + p.sum(axis=1)


# ---------------------------------------------------------------------------------------------
# The walk

def walk(q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, mask: np.ndarray, ng: int, scale: float,
         cap: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One warp's walk over keys 0 .. len(mask) - 1: q [HEADS, D] fp16 (rows >= ng unused), K, V
    [S, D] fp16, mask [S] additive (natural units). Returns what the warp leaves for the merge:
    o [HEADS, D] (unnormalized), m [HEADS] (base 2), l [HEADS]."""
    D = q.shape[1]
    dl = D // 32
    SK, RC, KS = step_keys(dl), D // 8, D // 16
    j_end = len(mask)
    lanes = np.arange(32)
    g, cq = lanes // 4, lanes % 4
    # q fragments: row g = head g (rows 4..15 zero), halves 16 ks + 2 cq (+1) and + 8
    qz = np.zeros((16, D), dtype=np.float16)
    qz[:ng] = q[:ng]
    qa = [[half2(qz[g, 16 * ks + 2 * cq], qz[g, 16 * ks + 2 * cq + 1]),
           half2(qz[g, 16 * ks + 8 + 2 * cq], qz[g, 16 * ks + 9 + 2 * cq])] for ks in range(KS)]
    zero = np.zeros((32, 2), dtype=np.float16)
    qscale = scale * LOG2E
    cap2 = None if cap is None else cap * LOG2E
    m_run = np.full(32, -np.inf)
    l_run = np.zeros(32)
    voff = SK * RC * 8  # halves
    if dl == 8:
        o = np.zeros((16, 32, 4))
    else:
        o = np.zeros((D // 8, 32, 4))
    for t in range(math.ceil(j_end / SK)):
        jb = t * SK
        st = fill_stage(k_rows, v_rows, jb, j_end, dl)
        if dl == 8:
            mk = np.stack([np.where(jb + 2 * cq + e < j_end, mask[np.minimum(jb + 2 * cq + e, j_end - 1)] * LOG2E, -np.inf)
                           for e in range(2)], axis=1)
            if not np.any(mk != -np.inf):
                continue
            kr_, kc = lanes & 7, lanes >> 3
            sc = [np.zeros((32, 4)), np.zeros((32, 4))]
            for ks in range(0, KS, 2):
                b = ldmatrix_x4(st, [(kr_[x] * RC + ((2 * ks + kc[x]) ^ kr_[x])) * 8 for x in range(32)], False)
                mma_16816(sc[0], [qa[ks][0], zero, qa[ks][1], zero], b[0:2])
                mma_16816(sc[1], [qa[ks + 1][0], zero, qa[ks + 1][1], zero], b[2:4])
            p, alpha, m_run, l_run = online_softmax((sc[0] + sc[1])[:, :2], mk, m_run, l_run, qscale, cap2)
            pb = half2(p[:, 0], p[:, 1])
            a0, a1 = alpha[8 * cq], alpha[8 * cq + 4]
            for mt in range(0, 16, 2):
                v = ldmatrix_x4(st, [voff + (kr_[x] * RC + ((2 * mt + kc[x]) ^ kr_[x])) * 8 for x in range(32)], True)
                for i in range(2):
                    o[mt + i] *= np.stack([a0, a1, a0, a1], axis=1)
                mma_1688(o[mt], v[0:2], pb)
                mma_1688(o[mt + 1], v[2:4], pb)
        else:
            mk = np.stack([np.where(jb + 8 * kt + 2 * cq + e < j_end,
                                    mask[np.minimum(jb + 8 * kt + 2 * cq + e, j_end - 1)] * LOG2E, -np.inf)
                           for kt in range(2) for e in range(2)], axis=1)  # [32, (kt, e)]
            if not np.any(mk != -np.inf):
                continue
            kr_, kc = (lanes >> 4) * 8 + (lanes & 7), (lanes >> 3) & 1
            vr_, vc = ((lanes >> 3) & 1) * 8 + (lanes & 7), lanes >> 4
            sc = [np.zeros((32, 4)), np.zeros((32, 4))]
            for ks in range(KS):
                b = ldmatrix_x4(st, [(kr_[x] * RC + ((2 * ks + kc[x]) ^ (kr_[x] & 7))) * 8 for x in range(32)], False)
                mma_16816(sc[0], [qa[ks][0], zero, qa[ks][1], zero], b[0:2])
                mma_16816(sc[1], [qa[ks][0], zero, qa[ks][1], zero], b[2:4])
            s = np.concatenate([sc[0][:, :2], sc[1][:, :2]], axis=1)  # (kt, e)
            p, alpha, m_run, l_run = online_softmax(s, mk, m_run, l_run, qscale, cap2)
            pa0, pa2 = half2(p[:, 0], p[:, 1]), half2(p[:, 2], p[:, 3])
            for nt in range(0, D // 8, 2):
                v = ldmatrix_x4(st, [voff + (vr_[x] * RC + ((nt + vc[x]) ^ (vr_[x] & 7))) * 8 for x in range(32)], True)
                o[nt][:, :2] *= alpha[:, None]
                o[nt + 1][:, :2] *= alpha[:, None]
                mma_16816(o[nt], [pa0, zero, pa2, zero], v[0:2])
                mma_16816(o[nt + 1], [pa0, zero, pa2, zero], v[2:4])
    l_run = l_run + l_run[lanes ^ 1]
    l_run = l_run + l_run[lanes ^ 2]
    out_o = np.zeros((HEADS, D))
    out_m = np.array([m_run[4 * h] for h in range(HEADS)])
    out_l = np.array([l_run[4 * h] for h in range(HEADS)])
    for x in range(32):
        if dl == 8:
            if cq[x] < 2:
                for mt in range(16):
                    out_o[2 * cq[x], 16 * mt + g[x]] = o[mt][x, 0]
                    out_o[2 * cq[x] + 1, 16 * mt + g[x]] = o[mt][x, 1]
                    out_o[2 * cq[x], 16 * mt + 8 + g[x]] = o[mt][x, 2]
                    out_o[2 * cq[x] + 1, 16 * mt + 8 + g[x]] = o[mt][x, 3]
        elif g[x] < HEADS:
            for nt in range(D // 8):
                out_o[g[x], 8 * nt + 2 * cq[x]] = o[nt][x, 0]
                out_o[g[x], 8 * nt + 2 * cq[x] + 1] = o[nt][x, 1]
    return out_o, out_m, out_l


def reference(q, k_rows, v_rows, mask, ng, scale, cap=None):
    """softmax(scale q.k (capped) + mask) v per head, in float64."""
    s = q[:ng].astype(np.float64) @ k_rows.astype(np.float64).T * scale
    if cap:
        s = cap * np.tanh(s / cap)
    s = s + mask[None, :]
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p @ v_rows.astype(np.float64)) / p.sum(axis=1, keepdims=True)


def check(D: int, keys: int, ng: int, masked: str = "none", cap: float | None = None, seed: int = 0) -> float:
    """Largest relative error of the emulated walk's normalized output against the reference, over
    the real heads (fp16 probabilities bound it near 1e-3)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((HEADS, D)).astype(np.float16)
    k_rows = rng.standard_normal((keys, D)).astype(np.float16)
    v_rows = rng.standard_normal((keys, D)).astype(np.float16)
    mask = np.zeros(keys)
    if masked == "head":  # a window: the first half hidden (whole steps skipped)
        mask[: keys // 2] = -np.inf
    elif masked == "tail":  # slots past the position
        mask[keys * 2 // 3:] = -np.inf
    scale = D ** -0.5
    o, m, l = walk(q, k_rows, v_rows, mask, ng, scale, cap)
    want = reference(q, k_rows, v_rows, mask, ng, scale, cap)
    got = o[:ng] / l[:ng, None]
    return float(np.abs(got - want).max() / np.abs(want).max())


def main() -> None:
    import json

    for D in (64, 128, 256):
        for keys, ng, masked, cap in ((16, 4, "none", None), (37, 3, "head", None), (24, 1, "tail", 1.5)):
            print(json.dumps({"D": D, "keys": keys, "heads": ng, "mask": masked, "cap": cap,
                              "max_rel_err": check(D, keys, ng, masked, cap)}))


if __name__ == "__main__":
    main()
