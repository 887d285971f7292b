"""Lane-level numpy emulation of the version-3 fused product (csrc/exl3_gemv.cuh).

Checks the index math of the kernel without a GPU: state extraction from the packed words, the
MMA fragment placement, prep_frag's activation layout, the warp work split, the per-128 fold and
the flush. Slow (pure Python loops); tiny shapes only.  python -m bench.gemv_emulator
"""
import numpy as np
import torch

from engine.formats.exl3 import reconstruct, codebook_lut, hadamard128

M32 = 0xFFFFFFFF

def funnel_l(lo, hi, sh):  # __funnelshift_l(lo, hi, sh): high 32 bits of (hi:lo) << sh
    sh &= 31
    v = ((int(hi) << 32) | int(lo)) << sh
    return (v >> 32) & M32
def funnel_r(lo, hi, sh):  # low 32 bits of (hi:lo) >> sh
    sh &= 31
    v = ((int(hi) << 32) | int(lo)) >> sh
    return v & M32
def byte_perm(x, y, s):
    b = [(int(x) >> (8*i)) & 0xFF for i in range(4)] + [(int(y) >> (8*i)) & 0xFF for i in range(4)]
    r = 0
    for i in range(4):
        r |= b[(s >> (4*i)) & 7] << (8*i)
    return r

def lane_window(K, lane):
    tb = 32 * K
    b = lane * K - 2
    if b < 0: b += tb
    return b >> 2, (b & 3) * 8
def wrap(K, w): return w - 8*K if w >= 8*K else w

def state_at(Q, h0, h1, h2):
    if Q + 16 <= 32: return (h0 >> (16 - Q)) & 0xFFFF
    if Q < 32: return funnel_r(h0, h1, 48 - Q) & 0xFFFF if False else funnel_r_(h1, h0, 48 - Q) & 0xFFFF
    if Q + 16 <= 64: return (h1 >> (48 - Q)) & 0xFFFF
    if Q < 64: return funnel_r_(h2, h1, 80 - Q) & 0xFFFF
    return (h2 >> (80 - Q)) & 0xFFFF
def funnel_r_(lo, hi, sh):  # __funnelshift_r(lo, hi, sh)
    return funnel_r(lo, hi, sh)

def states_generic(K, words, lane):
    wa, sh = lane_window(K, lane); wb = wrap(K, wa+1); wc = wrap(K, wa+2)
    w0, w1, w2 = int(words[wa]), int(words[wb]), int(words[wc])
    h0 = funnel_l(w1, w0, sh); h1 = funnel_l(w2, w1, sh); h2 = (w2 << sh) & M32
    return [state_at((j+1)*K, h0, h1, h2) for j in range(8)]

def states_k4(words, lane):
    wa, sh = lane_window(4, lane); wb = wrap(4, wa+1)
    A, B = int(words[wa]), int(words[wb])
    V = funnel_r(B, A, 4)
    st = [0]*8
    st[7] = B & 0xFFFF
    st[5] = byte_perm(B, 0, 0x4421)
    st[3] = B >> 16
    st[1] = byte_perm(B, A & 0xFF, 0x5543)
    st[6] = V & 0xFFFF
    st[4] = byte_perm(V, 0, 0x4421)
    st[2] = V >> 16
    st[0] = funnel_r(B, A, 28) & 0xFFFF
    return st

def tile_from_lanes(K, words, lut, use_k4):
    """What tile [k16, out16] as the kernel's MMA operand sees it."""
    T = np.zeros((16, 16))
    for lane in range(32):
        g, cq = lane >> 2, lane & 3
        st = states_k4(words, lane) if use_k4 else states_generic(K, words, lane)
        v = [lut[s] for s in st]
        # F16 A regs: v pairs (0,1)->a0 (out g, k 2cq..), (2,3)->a2 (g, k 2cq+8..), (4,5)->a1 (g+8, k 2cq), (6,7)->a3 (g+8, 2cq+8)
        T[2*cq, g], T[2*cq+1, g] = v[0], v[1]
        T[2*cq+8, g], T[2*cq+9, g] = v[2], v[3]
        T[2*cq, g+8], T[2*cq+1, g+8] = v[4], v[5]
        T[2*cq+8, g+8], T[2*cq+9, g+8] = v[6], v[7]
    return T

def check_tiles():
    """Each lane's decoded states, placed as MMA fragments, equal the reference tile."""
    rng = np.random.default_rng(0)
    for K in (1, 2, 3, 4, 5, 8):
        for cb in ("mul1",):
            tr = torch.from_numpy(rng.integers(-32768, 32768, (1, 1, 16*K), dtype=np.int64).astype(np.int16))
            ref = reconstruct(tr, cb).float().numpy()  # [16, 16] (in, out)
            lut = codebook_lut(cb).float().numpy()
            words = tr.numpy().reshape(-1).view(np.uint16).astype(np.uint32)
            words = words[0::2] | (words[1::2] << 16)
            T = tile_from_lanes(K, words, lut, False)
            ok = np.array_equal(T.astype(np.float32), ref)
            msg = f"K={K} generic tile ok={ok}"
            if K == 4:
                T4 = tile_from_lanes(K, words, lut, True)
                msg += f" k4 ok={np.array_equal(T4.astype(np.float32), ref)}"
            print(msg)


# ---------------- full kernel emulation ----------------
def hadamard_rows(x):  # x [m, in] fp32 -> had128 blocks, normalized
    return hadamard128(torch.from_numpy(x)).numpy()

def prep(x16, suh16, path, ng, m):
    """Emulate prep_frag: returns xb (uint32 flat), scales [m, nch, 2], csum [m, nch]."""
    mrow, n_in = x16.shape
    p = (torch.from_numpy(x16).half() * torch.from_numpy(suh16).half()).float().numpy()
    xh = hadamard_rows(p).astype(np.float16)  # kernel: fp32 wht then *norm, round to fp16
    tk = n_in // 16; nch = n_in // 128
    if path == "f16":
        xb = np.zeros(tk * ng * 32 * 2, dtype=np.uint32)
        for r in range(m):
            for k in range(0, n_in, 2):
                i, kk = k >> 4, k & 15
                fl = (r & 7) * 4 + ((kk & 7) >> 1)
                pair = np.array([xh[r, k], xh[r, k+1]], dtype=np.float16).view(np.uint32)[0]
                xb[((i * ng + (r >> 3)) * 32 + fl) * 2 + (kk >> 3)] = pair
        return xh, xb, None, None
    xb = np.zeros(tk * ng * 32 * 4, dtype=np.uint32)
    scales = np.zeros((m, nch, 2), np.float32); csum = np.zeros((m, nch), np.float32)
    for r in range(m):
        for c in range(nch):
            f = xh[r, c*128:(c+1)*128].astype(np.float32)
            amax = np.abs(f).max(); s1 = np.float32(amax / 127); s2 = np.float32(s1 / 254)
            inv1 = np.float32(127 / amax) if amax > 0 else 0; inv2 = np.float32(254 / s1) if amax > 0 else 0
            scales[r, c] = (s1, s2); csum[r, c] = f.sum()
            for kq in range(128):
                k = c*128 + kq
                q1 = np.clip(np.rint(f[kq]*inv1), -127, 127); res = f[kq] - q1*s1
                q2 = np.clip(np.rint(res*inv2), -127, 127)
                i, kk = k >> 4, k & 15
                cq = (kk & 7) >> 1; slot = (kk & 1) + 2*(kk >> 3)
                l1 = (2*(r & 3))*4 + cq; l2 = (2*(r & 3)+1)*4 + cq
                fb = (i * ng + (r >> 2)) * 32
                xb[(fb + l1)*4 + slot] = (int(q1) & 0xFF) * 0x01010101
                xb[(fb + l2)*4 + slot] = (int(q2) & 0xFF) * 0x01010101
    return xh, xb, scales, csum

def bytes_u8(w): return [(int(w) >> (8*i)) & 0xFF for i in range(4)]
def bytes_s8(w): return [((int(w) >> (8*i)) & 0xFF) - (256 if (int(w) >> (8*i)) & 0x80 else 0) for i in range(4)]

def mma_u8s8(d, A, B):
    """d: [32 lanes][4] int; A: [32][4] regs; B: [32][2] regs. m16n8k32."""
    Am = np.zeros((16, 32), np.int64); Bm = np.zeros((32, 8), np.int64)
    for l in range(32):
        g, cq = l >> 2, l & 3
        for r, (row, col0) in enumerate([(g, 4*cq), (g+8, 4*cq), (g, 16+4*cq), (g+8, 16+4*cq)]):
            Am[row, col0:col0+4] = bytes_u8(A[l][r])
        for r, row0 in enumerate([4*cq, 16+4*cq]):
            Bm[row0:row0+4, g] = bytes_s8(B[l][r])
    D = Am @ Bm
    for l in range(32):
        g, cq = l >> 2, l & 3
        d[l][0] += D[g, 2*cq]; d[l][1] += D[g, 2*cq+1]; d[l][2] += D[g+8, 2*cq]; d[l][3] += D[g+8, 2*cq+1]

def h2f(w): return np.array([w], dtype=np.uint32).view(np.float16).astype(np.float64)
def mma_f16(d, A, B):
    Am = np.zeros((16, 16)); Bm = np.zeros((16, 8))
    for l in range(32):
        g, cq = l >> 2, l & 3
        for r, (row, col0) in enumerate([(g, 2*cq), (g+8, 2*cq), (g, 2*cq+8), (g+8, 2*cq+8)]):
            Am[row, col0:col0+2] = h2f(A[l][r])
        for r, row0 in enumerate([2*cq, 2*cq+8]):
            Bm[row0:row0+2, g] = h2f(B[l][r])
    D = Am @ Bm
    for l in range(32):
        g, cq = l >> 2, l & 3
        d[l][0] += D[g, 2*cq]; d[l][1] += D[g, 2*cq+1]; d[l][2] += D[g+8, 2*cq]; d[l][3] += D[g+8, 2*cq+1]

def i8_tile_operand(K, tw):
    """Each lane's 8 states of one tile times the MUL1 multiplier: its bytes are the u8 A operand."""
    X = []
    for l in range(32):
        st = states_k4(tw, l) if K == 4 else states_generic(K, tw, l)
        X.append([(st_ * 0x83DCD12D) & M32 for st_ in st])
    return X

def mma_i8_tile(d, X, b):
    """The two m16n8k32 MMAs of one decoded tile against the lanes' B words b[lane] (4 each)."""
    mma_u8s8(d, [[X[l][0], X[l][4], X[l][1], X[l][5]] for l in range(32)], [[b[l][0], b[l][1]] for l in range(32)])
    mma_u8s8(d, [[X[l][2], X[l][6], X[l][3], X[l][7]] for l in range(32)], [[b[l][2], b[l][3]] for l in range(32)])

LUT = {cb: codebook_lut(cb).float().numpy() for cb in ("mul1", "mcg", "3inst")}
def decode_pair_f16(cb, s0, s1):
    v = np.array([LUT[cb][s0], LUT[cb][s1]], dtype=np.float16)
    return int(v.view(np.uint32)[0])

def emulate(K, cb, path, m, n_in, n_out, nwarps, seed=0):
    rng = np.random.default_rng(seed)
    tr = torch.from_numpy(rng.integers(-32768, 32768, (n_in//16, n_out//16, 16*K), dtype=np.int64).astype(np.int16))
    wd = tr.numpy().reshape(-1).view(np.uint16).astype(np.uint32); words = wd[0::2] | (wd[1::2] << 16)
    x = rng.standard_normal((m, n_in)).astype(np.float16)
    suh = (rng.integers(0, 2, n_in) * 2 - 1).astype(np.float16)
    if path == "i8": ng = 1 if m <= 4 else 2; CT = 8 if ng == 1 else 4; RPG = 4
    else: ng = 1 if m <= 8 else (2 if m <= 16 else 4); CT = {1: 8, 2: 4, 4: 2}[ng]; RPG = 8
    xh, xb, scales, csum = prep(x, suh, path, ng, m)
    tk, tn = n_in // 16, n_out // 16; TW = 8 * K; groups = tn // CT; units = groups * tk
    z = np.zeros((m, n_out))
    for gw in range(nwarps):
        u0 = units * gw // nwarps; u1 = units * (gw + 1) // nwarps
        if u0 >= u1: continue
        c_grp, c_row = u0 // tk, u0 % tk
        seg0 = c_row == 0
        iacc = np.zeros((ng, CT, 32, 4), np.int64); facc = np.zeros((ng, CT, 32, 2)); cadd = np.zeros((ng, 32))
        acc = np.zeros((ng, CT, 32, 4))
        def load_scales():
            sc = np.zeros((ng, 32, 2)); cs = np.zeros((ng, 32))
            for gr in range(ng):
                for l in range(32):
                    row = gr*4 + (l & 3)
                    if row < m: sc[gr, l] = scales[row, c_row >> 3]; cs[gr, l] = csum[row, c_row >> 3]
            return sc, cs
        if path == "i8": sc, cs = load_scales()
        for s in range(u1 - u0):
            base_tr = (c_row * tn + c_grp * CT) * TW  # the unit's trellis words (global)
            if path == "i8":
                b = [[(0, 0, 0, 0)] * 32 for _ in range(ng)]
                for gr in range(ng):
                    for l in range(32):
                        if gr*RPG + (l >> 3) < m:
                            o = ((c_row * ng + gr) * 32 + l) * 4
                            b[gr][l] = tuple(int(v) for v in xb[o:o+4])
                for ct in range(CT):
                    X = i8_tile_operand(K, words[base_tr + ct*TW: base_tr + (ct+1)*TW])
                    for gr in range(ng):
                        mma_i8_tile(iacc[gr, ct], X, b[gr])
            else:
                b = [[(0, 0)] * 32 for _ in range(ng)]
                for gr in range(ng):
                    for l in range(32):
                        if gr*RPG + (l >> 2) < m:
                            o = ((c_row * ng + gr) * 32 + l) * 2
                            b[gr][l] = (int(xb[o]), int(xb[o+1]))
                for ct in range(CT):
                    tw = words[base_tr + ct*TW: base_tr + (ct+1)*TW]
                    V = []
                    for l in range(32):
                        st = states_k4(tw, l) if K == 4 else states_generic(K, tw, l)
                        V.append([decode_pair_f16(cb, st[2*q], st[2*q+1]) for q in range(4)])
                    for gr in range(ng):
                        mma_f16(acc[gr, ct], [[V[l][0], V[l][2], V[l][1], V[l][3]] for l in range(32)], b[gr])
            last = s + 1 == u1 - u0
            chunk_end = (c_row & 7) == 7 or c_row + 1 == tk or last
            if chunk_end and path == "i8":
                for gr in range(ng):
                    for ct in range(CT):
                        facc[gr, ct, :, 0] += sc[gr, :, 0]*iacc[gr, ct, :, 0] + sc[gr, :, 1]*iacc[gr, ct, :, 1]
                        facc[gr, ct, :, 1] += sc[gr, :, 0]*iacc[gr, ct, :, 2] + sc[gr, :, 1]*iacc[gr, ct, :, 3]
                        iacc[gr, ct] = 0
            c_row += 1
            if c_row == tk or last:
                if path == "i8":
                    for gr in range(ng):
                        for l in range(32):
                            row = gr*4 + (l & 3)
                            cadd[gr, l] = csum[row].sum() if (row < m and seg0) else 0.0
                for gr in range(ng):
                    for ct in range(CT):
                        for l in range(32):
                            g, cq = l >> 2, l & 3
                            col = (c_grp*CT + ct)*16 + g
                            if path == "i8":
                                row = gr*4 + cq
                                if row < m:
                                    base = -3.453125 * cadd[gr, l]
                                    z[row, col] += 0.0067672729492188 * facc[gr, ct, l, 0] + base
                                    z[row, col+8] += 0.0067672729492188 * facc[gr, ct, l, 1] + base
                            else:
                                row = gr*8 + 2*cq
                                for dr, (i0, i1) in enumerate([(0, 2), (1, 3)]):
                                    if row + dr < m:
                                        z[row+dr, col] += acc[gr, ct, l, i0]; z[row+dr, col+8] += acc[gr, ct, l, i1]
                if not last:
                    iacc[:] = 0; facc[:] = 0; cadd[:] = 0; acc[:] = 0; c_row = 0; c_grp += 1; seg0 = True
            if chunk_end and not last and path == "i8": sc, cs = load_scales()
    W = reconstruct(tr, cb).float().numpy()
    ref = xh.astype(np.float64) @ W.astype(np.float64)
    err = np.sqrt(((z - ref)**2).mean() / (ref**2).mean())
    return err

def sp_slot(f, s1, s2, inv1, inv2):
    """A self-prepping product's chunk slot (sp_store_chunk): 64 data words, the steps, k-row sums."""
    data = np.zeros(64 * 4, np.uint8).reshape(64, 4)
    rows = np.zeros(8)
    for l in range(32):
        krow, kk0 = l >> 2, (l & 3) * 4
        cqa, h = (kk0 & 7) >> 1, kk0 >> 3
        q = []
        for j in range(4):
            v = f[l*4 + j]
            q1 = np.clip(np.rint(v*inv1), -127, 127); q2 = np.clip(np.rint((v - q1*s1)*inv2), -127, 127)
            q.append((int(q1), int(q2)))
        for p_ in range(2):
            w = (p_*8 + krow)*4 + cqa
            data[w, 2*h], data[w, 2*h+1] = q[0][p_] & 0xFF, q[1][p_] & 0xFF
            data[w+1, 2*h], data[w+1, 2*h+1] = q[2][p_] & 0xFF, q[3][p_] & 0xFF
        rows[krow] += s1*sum(a for a, _ in q) + s2*sum(b for _, b in q)
    return data, rows

def emulate_sp(K, n_in, n_out, nwarps, seed=0):
    """The self-prepping decode product (m = 1, integer path, one k row per unit): each warp's
    chunk walk, its slots' layout as the B operand, and every warp adding its own k rows' MUL1
    constant part."""
    rng = np.random.default_rng(seed)
    tr = torch.from_numpy(rng.integers(-32768, 32768, (n_in//16, n_out//16, 16*K), dtype=np.int64).astype(np.int16))
    wd = tr.numpy().reshape(-1).view(np.uint16).astype(np.uint32); words = wd[0::2] | (wd[1::2] << 16)
    x = rng.standard_normal((1, n_in)).astype(np.float16)
    suh = (rng.integers(0, 2, n_in) * 2 - 1).astype(np.float16)
    xh, _, scales, _ = prep(x, suh, "i8", 1, 1)
    CT = 8; tk, tn = n_in // 16, n_out // 16; TW = 8 * K; units = (tn // CT) * tk
    z = np.zeros((1, n_out))
    for gw in range(nwarps):
        u0 = units * gw // nwarps; u1 = units * (gw + 1) // nwarps
        if u0 >= u1: continue
        slots = []  # the walk (SpWalk), one k row per unit
        grp, row, left = u0 // tk, u0 % tk, u1 - u0
        while left > 0:
            c = row >> 3
            f = xh[0, c*128:(c+1)*128].astype(np.float32)
            s1, s2 = scales[0, c]
            amax = np.abs(f).max()
            inv1 = np.float32(127 / amax) if amax > 0 else 0; inv2 = np.float32(254 / s1) if amax > 0 else 0
            slots.append(sp_slot(f, s1, s2, inv1, inv2) + ((s1, s2),))
            rh = min((c + 1) * 8, tk) - row; left -= rh; row += rh
            if row == tk: row = 0; grp += 1
        c_grp, c_row, slot = u0 // tk, u0 % tk, 0
        iacc = np.zeros((CT, 32, 4), np.int64); facc = np.zeros((CT, 32, 2)); cpart = 0.0
        sc = np.array([slots[0][2] if (l & 3) == 0 else (0, 0) for l in range(32)])
        for s in range(u1 - u0):
            data, rows, _ = slots[slot]
            krow = c_row & 7
            b = []
            for l in range(32):
                w = data[((l >> 2)*8 + krow)*4 + (l & 3)] if l < 8 else np.zeros(4, np.uint8)
                b.append(tuple(int(w[j]) * 0x01010101 for j in range(4)))
            cpart += rows[krow]
            base_tr = (c_row * tn + c_grp * CT) * TW
            for ct in range(CT):
                mma_i8_tile(iacc[ct], i8_tile_operand(K, words[base_tr + ct*TW: base_tr + (ct+1)*TW]), b)
            last = s + 1 == u1 - u0
            chunk_end = (c_row & 7) == 7 or c_row + 1 == tk or last
            if chunk_end:
                for ct in range(CT):
                    facc[ct, :, 0] += sc[:, 0]*iacc[ct, :, 0] + sc[:, 1]*iacc[ct, :, 1]
                    facc[ct, :, 1] += sc[:, 0]*iacc[ct, :, 2] + sc[:, 1]*iacc[ct, :, 3]
                    iacc[ct] = 0
            c_row += 1
            if c_row == tk or last:
                for ct in range(CT):
                    for l in range(0, 32, 4):  # lanes with cq == 0 hold row 0
                        col = (c_grp*CT + ct)*16 + (l >> 2)
                        base = -3.453125 * cpart
                        z[0, col] += 0.0067672729492188 * facc[ct, l, 0] + base
                        z[0, col+8] += 0.0067672729492188 * facc[ct, l, 1] + base
                if not last:
                    facc[:] = 0; cpart = 0.0; c_row = 0; c_grp += 1
            if chunk_end and not last:
                slot += 1
                sc = np.array([slots[slot][2] if (l & 3) == 0 else (0, 0) for l in range(32)])
    W = reconstruct(tr, "mul1").float().numpy()
    ref = xh.astype(np.float64) @ W.astype(np.float64)
    return np.sqrt(((z - ref)**2).mean() / (ref**2).mean())

if __name__ == "__main__":
    for (K, n_in, nw) in [(4, 256, 5), (3, 384, 7), (4, 512, 3)]:
        print("self prep", K, n_in, nw, "rel err", emulate_sp(K, n_in, 256, nw))
    check_tiles()
    for (K, cb, path, m, nw) in [(4, "mul1", "i8", 1, 5), (4, "mul1", "i8", 3, 7), (3, "mul1", "i8", 6, 3),
                                 (4, "mcg", "f16", 1, 5), (4, "3inst", "f16", 11, 3), (2, "mul1", "f16", 20, 4)]:
        print(K, cb, path, m, nw, "rel err", emulate(K, cb, path, m, 256, 256, nw))
