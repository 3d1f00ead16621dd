"""NumPy emulator of kda_chunk_prep_{mma,blk}_D + kda_chunk_mma_D_{split,half} (kernels/kda.cu).

Usage: python3 scripts/cuda/emulate/kda_chunk_mma.py [64|128]  (numpy; ~30 s per head size)

Emulates the scratch byte layout, the cp.async group schedule (eagerly or lazily applied),
the shared-memory carve-up, per-lane ldmatrix (.trans) addresses and register contents,
mma.sync m16n8k16 fragments and bf16 hi/lo splitting, and compares with a float64 reference
of the gated delta rule recurrence."""
import sys
import numpy as np

C = 64
NW = 4


def bf16_bits(x):
    """f32 -> bf16 bits, round to nearest even (as __float2bfloat16_rn for finite x)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return r.astype(np.uint16)


def bf16_val(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def split_hilo(x):
    x = np.asarray(x, dtype=np.float32)
    h = bf16_bits(x)
    lo = bf16_bits((x - bf16_val(h)).astype(np.float32))
    return h, lo


# ---------------------------------------------------------------- reference (float64)
def reference(q, k, v, g, beta, segs, states, H, D):
    n = q.shape[0]
    out = np.zeros((n, H * D))
    new_states = []
    for (start, ln), S0 in zip(segs, states):
        S_all = S0.astype(np.float64).copy()
        for h in range(H):
            S = S_all[h]
            for t in range(start, start + ln):
                sl = slice(h * D, (h + 1) * D)
                qt = q[t, sl].astype(np.float64)
                kt = k[t, sl].astype(np.float64)
                qt = qt / np.sqrt(D) / np.sqrt((qt * qt).sum() + 1e-6)
                kt = kt / np.sqrt((kt * kt).sum() + 1e-6)
                S = np.exp(g[t, sl].astype(np.float64))[:, None] * S
                u = beta[t, h] * (v[t, sl] - S.T @ kt)
                S = S + np.outer(kt, u)
                out[t, sl] = S.T @ qt
            S_all[h] = S
        new_states.append(S_all)
    return out, new_states


# ---------------------------------------------------------------- prep (f32) into scratch
def scratch_bytes(D):
    return (6 * C * D + 4 * C * C) * 2 + 4 * D


def prep(q, k, g, beta, segs, H, D, split, blk=False):
    chunk0, nchunks = [], 0
    for (s, ln) in segs:
        chunk0.append(nchunks)
        nchunks += -(-ln // C)
    SB = scratch_bytes(D)
    # NaN patterns everywhere first: lo planes stay NaN without split (never read then).
    scratch = np.full(nchunks * H * SB, 0xFF, dtype=np.uint8)
    f32 = np.float32
    for si, (start, ln) in enumerate(segs):
        for ci in range(-(-ln // C)):
            l = min(C, ln - ci * C)
            row0 = start + ci * C
            for h in range(H):
                sl = slice(h * D, (h + 1) * D)
                Q = np.zeros((C, D), f32); K = np.zeros((C, D), f32); A_ = np.ones((C, D), f32)
                Q[:l] = q[row0:row0 + l, sl]; K[:l] = k[row0:row0 + l, sl]
                A_[:l] = np.exp(g[row0:row0 + l, sl].astype(f32))
                B = np.zeros(C, f32); B[:l] = beta[row0:row0 + l, h]
                rq = f32(1 / np.sqrt(f32(D))) / np.sqrt((Q * Q).sum(1) + f32(1e-6))
                rk = f32(1) / np.sqrt((K * K).sum(1) + f32(1e-6))
                Qn = (Q * rq[:, None]).astype(f32); Kn = (K * rk[:, None]).astype(f32)
                # P(c, r) = prod_{c<s<=r} a_s, as running products.
                Lm = np.zeros((C, C), f32); Am = np.zeros((C, C), f32)
                for c in range(C):
                    run = Kn[c].copy()
                    for r in range(c, l):
                        if r > c:
                            run = (run * A_[r]).astype(f32)
                        Am[r, c] = f32(np.dot(Qn[r], run))
                        if r > c:
                            Lm[r, c] = f32(np.dot(Kn[r], run))
                if blk:
                    Am, Lm, KG_, QG_, Kd_, fs_ = prep_blk_chunk(Qn, Kn, A_, l, D)
                # T by forward substitution (solve_t).
                T = np.zeros((C, C), f32)
                for j in range(C):
                    x = np.zeros(C, f32); x[j] = 1
                    for c in range(C):
                        tc = f32(B[c] * x[c]); x[c] = tc
                        x[c + 1:] = (x[c + 1:] - Lm[c + 1:, c] * tc).astype(f32)
                    T[:, j] = x
                # Decayed rows.
                Kd = np.zeros((C, D), f32); te = np.ones(D, f32)
                for r in range(C - 1, -1, -1):
                    Kd[r] = Kn[r] * te; te = (te * A_[r]).astype(f32)
                KG = np.zeros((C, D), f32); QG = np.zeros((C, D), f32); fs = np.ones(D, f32)
                for r in range(C):
                    fs = (fs * A_[r]).astype(f32)
                    KG[r] = Kn[r] * fs; QG[r] = Qn[r] * fs
                if blk:
                    KG, QG, Kd, fs = KG_, QG_, Kd_, fs_
                slot = (chunk0[si] + ci) * H + h
                base = slot * SB
                bf = scratch[base:base + SB - 4 * D].view(np.uint16)
                off = 0
                for mat in (KG, QG, T, Am, Kd):
                    hi, lo = split_hilo(mat.reshape(-1))
                    n = mat.size
                    bf[off:off + n] = hi
                    if split:
                        bf[off + n:off + 2 * n] = lo
                    off += 2 * n
                scratch[base + SB - 4 * D:base + SB].view(np.float32)[:] = fs
    return scratch, chunk0


def prep_blk_chunk(Qn, Kn, A_, l, D):
    """kda_chunk_prep_blk_D after the norms: A, L, KG, QG, Kd, gamma, following the kernel's
    thread mapping (lane groups of the diagonal pass, warps/lanes of the block products)."""
    f32 = np.float32
    Qs, Ks, As = Qn.copy(), Kn.copy(), A_.copy()
    Ms = np.zeros((C, C), f32)
    done = np.zeros((C, C), bool)
    # Diagonal blocks: warp w, lane group p = 4w + j, passes c = p and c = C-1-p.
    for w in range(8):
        for pas in range(2):
            rmin = 4 * w if pas == 0 else C - 4 - 4 * w
            rend = min(l, (rmin & ~15) + 16)
            for j in range(4):
                p = 4 * w + j
                c = p if pas == 0 else C - 1 - p
                run = Ks[c].copy()
                for r in range(rmin, rend):
                    if r > c:
                        run = (run * As[r]).astype(f32)
                    if r >= c:
                        Ms[r, c] = f32(np.dot(Qs[r], run)); done[r, c] = True
                        if r > c:
                            Ms[c, r] = f32(np.dot(Ks[r], run)); done[c, r] = True
    # Block factors.
    gt = np.ones((4, D), f32)
    for R in range(4):
        av = As[16 * R:16 * R + 16].copy(); kv = Ks[16 * R:16 * R + 16].copy()
        bl = np.ones(D, f32)
        for m in range(15, -1, -1):
            As[16 * R + m] = kv[m] * bl; bl = (bl * av[m]).astype(f32)
        fl = np.ones(D, f32)
        for m in range(16):
            fl = (fl * av[m]).astype(f32)
            Ks[16 * R + m] = kv[m] * fl; Qs[16 * R + m] = Qs[16 * R + m] * fl
        gt[R] = fl
    Xs = np.concatenate([gt[1], gt[2]])
    for w in range(6):
        R = w + 1 if w < 3 else (w - 1 if w < 5 else 3)
        Cb = w if w < 3 else (1 if w == 4 else 0)
        if 16 * R >= l:
            for r in range(16 * R, 16 * R + 16):
                for c in range(16 * Cb, 16 * Cb + 16):
                    done[r, c] = done[c, r] = True  # stay zero
            continue
        m4 = np.ones(D, f32)
        if w in (3, 5):
            m4 = Xs[:D].copy()
        if w >= 4:
            m4 = (m4 * Xs[D:]).astype(f32)
        for lane in range(32):
            r0 = 16 * R + 2 * (lane >> 2); c0 = 16 * Cb + 4 * (lane & 3)
            for mr in range(2):
                for jj in range(4):
                    r, c = r0 + mr, c0 + jj
                    b = (As[c] * m4).astype(f32)
                    Ms[r, c] = f32(np.dot(Qs[r], b)); Ms[c, r] = f32(np.dot(Ks[r], b))
                    assert not done[r, c] and not done[c, r]
                    done[r, c] = done[c, r] = True
    for r in range(l, C):  # rows past the end: never written, zero
        done[r, :r + 1] = True; done[:r, r] = True
    assert done.all() or np.all(Ms[~done] == 0), "uncovered pairs"
    Am = np.tril(Ms); Lm = np.tril(Ms.T, -1)
    KG = np.zeros((C, D), f32); QG = np.zeros((C, D), f32); Kd = np.zeros((C, D), f32)
    pre = np.ones(D, f32)
    for R in range(4):
        for m in range(16):
            r = 16 * R + m
            KG[r] = Ks[r] * pre; QG[r] = Qs[r] * pre
        pre = (pre * gt[R]).astype(f32)
    post = np.ones(D, f32)
    for R in range(3, -1, -1):
        for m in range(16):
            r = 16 * R + m
            Kd[r] = As[r] * post
        post = (post * gt[R]).astype(f32)
    return Am, Lm, KG, QG, Kd, pre


# ---------------------------------------------------------------- warp primitives
lanes = np.arange(32)
G = lanes >> 2
Cq = lanes & 3


class Smem:
    def __init__(self, nbytes):
        self.b = np.full(nbytes, 0xFF, dtype=np.uint8)

    def u16_row(self, addr):  # 8 bf16 at a 16-byte aligned byte address
        assert addr % 16 == 0 and addr + 16 <= len(self.b), addr
        return self.b[addr:addr + 16].view(np.uint16)

    def f32(self, addr):
        assert addr % 4 == 0
        return self.b[addr:addr + 4].view(np.float32)[0]


def pack(lo_u16, hi_u16):
    return (np.asarray(lo_u16, np.uint32) | (np.asarray(hi_u16, np.uint32) << 16)).astype(np.uint32)


def ldsm(sm, addrs, trans):
    rows = [sm.u16_row(int(a)) for a in addrs]  # lane l supplies row l%8 of matrix l//8
    regs = []
    for m in range(4):
        M = np.stack(rows[8 * m:8 * m + 8])  # [8 rows][8 cols]
        if not trans:
            e0 = M[lanes >> 2, 2 * (lanes & 3)]; e1 = M[lanes >> 2, 2 * (lanes & 3) + 1]
        else:
            e0 = M[2 * (lanes & 3), lanes >> 2]; e1 = M[2 * (lanes & 3) + 1, lanes >> 2]
        regs.append(pack(e0, e1))
    return regs


def unpack(r):
    r = np.asarray(r, np.uint32)
    return bf16_val((r & 0xFFFF).astype(np.uint16)), bf16_val((r >> 16).astype(np.uint16))


def mma(cacc, a, b0, b1):
    """cacc: [4][32] f32; a: 4 regs [32] u32; b0, b1: [32] u32."""
    A = np.zeros((16, 16)); B = np.zeros((16, 8)); Cm = np.zeros((16, 8))
    for idx, (ro, co) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        x0, x1 = unpack(a[idx])
        A[G + ro, 2 * Cq + co] = x0; A[G + ro, 2 * Cq + co + 1] = x1
    for idx, ko in enumerate((0, 8)):
        x0, x1 = unpack((b0, b1)[idx])
        B[2 * Cq + ko, G] = x0; B[2 * Cq + ko + 1, G] = x1
    Cm[G, 2 * Cq] = cacc[0]; Cm[G, 2 * Cq + 1] = cacc[1]
    Cm[G + 8, 2 * Cq] = cacc[2]; Cm[G + 8, 2 * Cq + 1] = cacc[3]
    Dm = (A @ B + Cm).astype(np.float32)
    return np.stack([Dm[G, 2 * Cq], Dm[G, 2 * Cq + 1], Dm[G + 8, 2 * Cq], Dm[G + 8, 2 * Cq + 1]])


def ksplit(x, y, split):
    hx, lx = split_hilo(x); hy, ly = split_hilo(y)
    return pack(hx, hy), (pack(lx, ly) if split else None)


def afrag(c0, c1, split):
    ah, al = [None] * 4, [None] * 4
    for i, (src, e) in enumerate(((c0, 0), (c0, 2), (c1, 0), (c1, 2))):
        ah[i], al[i] = ksplit(src[e], src[e + 1], split)
    return ah, al


def mma2(c0, c1, ah, al, sm, addrs, lo, trans, split):
    bh = ldsm(sm, addrs, trans)
    c0 = mma(c0, ah, bh[0], bh[1]); c1 = mma(c1, ah, bh[2], bh[3])
    if split:
        bl = ldsm(sm, addrs + lo, trans)
        c0 = mma(c0, al, bh[0], bh[1]); c1 = mma(c1, al, bh[2], bh[3])
        c0 = mma(c0, ah, bl[0], bl[1]); c1 = mma(c1, ah, bl[2], bl[3])
    return c0, c1


# ---------------------------------------------------------------- the state kernel
def chunk_mma(v, segs, chunk0, scratch, out, states, H, D, split, eager):
    NP = 2 if split else 1
    LD, LC = D + 8, C + 8
    PD, PC = C * LD, C * LC
    BV = 16 * NW; LV = BV + 4
    GD, GC = C * D, C * C
    SB = scratch_bytes(D)
    NTD = D // 8
    width = H * D
    # byte offsets of the carve-up
    KGs = 0; QGs = KGs + NP * PD * 2; Ts = QGs + NP * PD * 2; As = Ts + NP * PC * 2
    Kds = As + NP * PC * 2; Vs = Kds + NP * PD * 2; Gs = Vs + C * LV * 4
    smem_bytes = Gs + D * 4
    assert smem_bytes == NP * (3 * C * (D + 8) + 2 * C * (C + 8)) * 2 + C * (16 * NW + 4) * 4 + D * 4
    NT = 32 * NW
    for sg, (start, ln) in enumerate(segs):
        for h in range(H):
            for bx in range(D // BV):
                sm = Smem(smem_bytes)
                nch = -(-ln // C)
                hoff = h * D; vcol0 = bx * BV
                pending = []  # groups: list of (dst, bytes) writes

                def chunk_base(ci):
                    return ((chunk0[sg] + ci) * H + h) * SB

                def planes(dst, src, rw, ld, gplane):
                    wr = []
                    per_row = rw // 8; n = C * per_row
                    for p in range(NP):
                        for tid in range(NT):
                            for e in range(tid, n, NT):
                                r, cc = e // per_row, e % per_row
                                d_ = dst + (p * C * ld + r * ld + cc * 8) * 2
                                s_ = src + (p * gplane + r * rw + cc * 8) * 2
                                wr.append((d_, scratch[s_:s_ + 16].copy()))
                    return wr

                def commit(wr):
                    if eager:
                        for d_, data in wr:
                            sm.b[d_:d_ + 16] = data
                        pending.append([])
                    else:
                        pending.append(wr)

                def wait2():
                    while len(pending) > 2:
                        for d_, data in pending.pop(0):
                            sm.b[d_:d_ + 16] = data

                def g0(ci):
                    wr = []
                    if ci < nch:
                        b = chunk_base(ci)
                        wr += planes(KGs, b, D, LD, GD)
                        wr += planes(QGs, b + 2 * GD * 2, D, LD, GD)
                        row0 = start + ci * C; l = min(C, ln - ci * C)
                        for e in range(C * BV // 4):
                            r, cc = e // (BV // 4), (e % (BV // 4)) * 4
                            src = v[row0 + min(r, l - 1), hoff + vcol0 + cc:hoff + vcol0 + cc + 4]
                            data = src.astype(np.float32).view(np.uint8).copy() if r < l else np.zeros(16, np.uint8)
                            wr.append((Vs + (r * LV + cc) * 4, data))
                    commit(wr)

                def g1(ci):
                    commit(planes(Ts, chunk_base(ci) + 4 * GD * 2, C, LC, GC) if ci < nch else [])

                def g2(ci):
                    commit(planes(As, chunk_base(ci) + (4 * GD + 2 * GC) * 2, C, LC, GC) if ci < nch else [])

                def g3(ci):
                    wr = []
                    if ci < nch:
                        b = chunk_base(ci) + (4 * GD + 4 * GC) * 2
                        wr += planes(Kds, b, D, LD, GD)
                        for e in range(D // 4):
                            s_ = b + 2 * GD * 2 + 16 * e
                            wr.append((Gs + 16 * e, scratch[s_:s_ + 16].copy()))
                    commit(wr)

                g0(0); g1(0); g2(0); g3(0)
                l7, l8, l16 = lanes & 7, (lanes >> 3) & 1, lanes >> 4
                kga = KGs + ((l7 + 8 * l16) * LD + 8 * l8) * 2
                qga = QGs + ((l7 + 8 * l16) * LD + 8 * l8) * 2
                ta = Ts + ((l7 + 8 * l16) * LC + 8 * l8) * 2
                aa = As + ((l7 + 8 * l16) * LC + 8 * l8) * 2
                kda = Kds + ((l7 + 8 * l8) * LD + 8 * l16) * 2
                lod, loc = PD * 2, PC * 2
                S = states[sg][h]  # [D][D] f32, updated in place
                st = []
                for w in range(NW):
                    colg = vcol0 + 16 * w + G
                    s_w = np.zeros((NTD, 4, 32), np.float32)
                    for nt in range(NTD):
                        for e in range(4):
                            s_w[nt, e] = S[8 * nt + 2 * Cq + (e & 1), colg + 8 * (e >> 1)]
                    st.append(s_w)
                for ci in range(nch):
                    row0 = start + ci * C; l = min(C, ln - ci * C)
                    wait2()
                    if ci > 0:
                        g3(ci)
                    pk, o, xh, xl = [None] * NW, [None] * NW, [None] * NW, [None] * NW
                    for w in range(NW):
                        pkw = np.zeros((8, 4, 32), np.float32); ow = np.zeros((8, 4, 32), np.float32)
                        for ks in range(D // 16):
                            ah, al = afrag(st[w][2 * ks], st[w][2 * ks + 1], split)
                            for np_ in range(4):
                                off = (np_ * 16 * LD + ks * 16) * 2
                                pkw[2 * np_], pkw[2 * np_ + 1] = mma2(pkw[2 * np_], pkw[2 * np_ + 1], ah, al, sm, kga + off, lod, False, split)
                                ow[2 * np_], ow[2 * np_ + 1] = mma2(ow[2 * np_], ow[2 * np_ + 1], ah, al, sm, qga + off, lod, False, split)
                        for nt in range(8):
                            for e in range(4):
                                for ln_ in range(32):
                                    addr = Vs + ((8 * nt + 2 * Cq[ln_] + (e & 1)) * LV + 16 * w + G[ln_] + 8 * (e >> 1)) * 4
                                    pkw[nt, e, ln_] = np.float32(sm.f32(addr) - pkw[nt, e, ln_])
                        xh[w], xl[w] = zip(*[afrag(pkw[2 * ks], pkw[2 * ks + 1], split) for ks in range(4)])
                        o[w] = ow
                    wait2(); g0(ci + 1)
                    uh, ul = [None] * NW, [None] * NW
                    for w in range(NW):
                        vn = np.zeros((8, 4, 32), np.float32)
                        for np_ in range(4):
                            for ks in range(np_ + 1):
                                vn[2 * np_], vn[2 * np_ + 1] = mma2(vn[2 * np_], vn[2 * np_ + 1], xh[w][ks], xl[w][ks], sm, ta + (np_ * 16 * LC + ks * 16) * 2, loc, False, split)
                        uh[w], ul[w] = zip(*[afrag(vn[2 * ks], vn[2 * ks + 1], split) for ks in range(4)])
                    wait2(); g1(ci + 1)
                    for w in range(NW):
                        ow = o[w]
                        for np_ in range(4):
                            for ks in range(np_ + 1):
                                ow[2 * np_], ow[2 * np_ + 1] = mma2(ow[2 * np_], ow[2 * np_ + 1], uh[w][ks], ul[w][ks], sm, aa + (np_ * 16 * LC + ks * 16) * 2, loc, False, split)
                        colg = vcol0 + 16 * w + G
                        for nt in range(8):
                            for e in range(4):
                                r = 8 * nt + 2 * Cq + (e & 1)
                                m = r < l
                                out[row0 + r[m], hoff + (colg + 8 * (e >> 1))[m]] = ow[nt, e][m]
                    wait2(); g2(ci + 1)
                    for w in range(NW):
                        for nt in range(NTD):
                            gx = np.array([sm.f32(Gs + (8 * nt + 2 * cq) * 4) for cq in Cq], np.float32)
                            gy = np.array([sm.f32(Gs + (8 * nt + 2 * cq + 1) * 4) for cq in Cq], np.float32)
                            st[w][nt, 0] *= gx; st[w][nt, 1] *= gy; st[w][nt, 2] *= gx; st[w][nt, 3] *= gy
                        for np_ in range(D // 16):
                            for ks in range(4):
                                st[w][2 * np_], st[w][2 * np_ + 1] = mma2(st[w][2 * np_], st[w][2 * np_ + 1], uh[w][ks], ul[w][ks], sm, kda + (ks * 16 * LD + np_ * 16) * 2, lod, True, split)
                for w in range(NW):
                    colg = vcol0 + 16 * w + G
                    for nt in range(NTD):
                        for e in range(4):
                            S[8 * nt + 2 * Cq + (e & 1), colg + 8 * (e >> 1)] = st[w][nt, e]


def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    return np.sqrt(((a - b) ** 2).sum() / (b ** 2).sum())


def main():
    D = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    lens = [100, 3, 47]
    H = 2
    rng = np.random.default_rng(5)
    n = sum(lens)
    W = H * D
    q = rng.uniform(-1, 1, (n, W)).astype(np.float32)
    k = rng.uniform(-1, 1, (n, W)).astype(np.float32)
    v = rng.uniform(-1, 1, (n, W)).astype(np.float32)
    # softplus-like gate: mostly mild decay, every 11th channel very strong decay.
    f = rng.uniform(-3, 3, (n, W)); f[:, ::11] += 25
    g = (-np.exp(0.3) * np.log1p(np.exp(np.minimum(f, 30)))).astype(np.float32)
    beta = rng.uniform(0, 1, (n, H)).astype(np.float32)
    segs, s0 = [], 0
    for l_ in lens:
        segs.append((s0, l_)); s0 += l_
    states = [rng.uniform(-0.3, 0.3, (H, D, D)).astype(np.float32) for _ in lens]
    want_o, want_s = reference(q, k, v, g, beta, segs, states, H, D)
    runs = [(s_, e_, False) for s_ in (True, False) for e_ in (False, True)]
    runs += [(True, False, True), (False, False, True)]
    for split, eager, blk in runs:
        if True:
            scratch, chunk0 = prep(q, k, g, beta, segs, H, D, split, blk)
            out = np.zeros((n, W), np.float32)
            st = [s.copy() for s in states]
            chunk_mma(v, segs, chunk0, scratch, out, st, H, D, split, eager)
            es = [rel(a, b) for a, b in zip(st, want_s)]
            print(f"D={D} {'blk ' if blk else 'mma '}{'split' if split else 'half '} {'eager' if eager else 'lazy '} cp.async: "
                  f"out rel err {rel(out, want_o):.2e}, states " + " ".join(f"{e:.2e}" for e in es),
                  flush=True)


if __name__ == "__main__":
    main()
