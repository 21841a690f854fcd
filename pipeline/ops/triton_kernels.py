"""The Triton kernels of the all-attention op (``pipeline.ops.triton_attention`` launches them).

One query block of T rows (queries i0 .. i0 + T - 1) meets its window of keys in tiles of T
keys: tile k holds key indices c = i0 + kT + t, so a score's context column is

    j = c - i = kT + t - r        (r, t: row and column inside the tile)

and a block of T queries touches T + L' - 1 keys, never the whole sequence. The score, in
log2 units (s2 = s * log2 e, so the softmax runs on exp2):

    s2[r, t] = (q_i . k_c + q_i . u_j) / sqrt(d_h) * log2 e + log2 m_h(j)      0 <= j < L'

The span mask multiplies the weights, as the reference does, and enters the denominator
with the reference's +1e-8 guard: with e = exp2(s2 - max) over every key of the row (window
and persistent), the weight of context key c is

    P_c = e_c m(j) / D,      D = sum_c e_c m(j) + sum_n e_n + eps * sum_all e      (eps 1e-8)

which is a m r of attend_reference (a = softmax(s), r = 1 / (sum(a m) + eps)) term by term: a
key with m = 0 weighs exactly 0 whatever its score, a window whose mask is 0 throughout gives
0, and the backward's weights e / D are bounded by 1 / eps as the reference's a r are. The
forward stores log2 D + max per row (``lse``); the backward recomputes e / D = exp2(s2 - lse)
and gives, with dp = dO . v (after dropout) and delta = dO . out,

    dS_c = m P'_c (dp_c - delta) - eps delta e_c / D     (P' = e / D; m = 1 for persistent)
    dm_c = e_c / D (dp_c - delta)

q . u is a matmul in distance space, not in key space: R_k = q @ pos[:, kT : kT + T] holds
q_i . u_(kT + jj) at [r, jj]. Tile k needs the distances kT - T + 1 .. kT + T - 1, i.e.
chunks k - 1 and k, at column (t - r) mod T of R_(k-1) (t < r) or R_k (t >= r): one register
gather per chunk, and each chunk is computed once per block (carried to the next tile).
The backward runs the same map the other way: dS of tile k, gathered at column (jj + r) mod
T, is distance chunk k's part (jj + r < T) and chunk k - 1's (jj + r >= T); a chunk is
complete after two tiles, and then gives q's position gradient and u's (q^T D) in one go;
m's gradient (the column sums of dm by distance) is gathered the same way: per-block
partial sums that the caller reduces once, with no atomics.

The N persistent keys follow the window as dense key tiles in the same online softmax, with
no position term and no mask. Dropout keeps weight (b, h, i, key) when 16 bits of a 32-bit
hash of (seed, b, h, i, key coordinate >> 1) pass ``threshold``
(``pipeline.ops.dropout.flex_keep``: the same bits as the flex backend; key coordinate: the
key index c = i + j, or -1 - n for persistent vector n): a tile's keys start at an even
coordinate, so one hash of each pair of columns gives both keep decisions (the low half for
the even key, the high half for the odd one), [T, T / 2] hashes per tile of T x T scores.
The backward regenerates the mask and nothing is stored. Gradients accumulate in float32
and are stored scaled, in the dtype of the output tensors (the inputs').
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _keep(seed, b, h, qi, c, threshold, T: tl.constexpr):
    """flex_keep's hash in uint32 arithmetic (wrap-around products, logical shifts) for a
    [T, T] tile of weights: rows ``qi`` ([T, 1]), key coordinates ``c`` ([1, T] or [T, T],
    columns 2s and 2s + 1 of one pair c >> 1). One hash per pair of columns ([T, T / 2]),
    its low 16 bits for the even key, its high 16 bits for the odd one."""
    pairs = tl.reshape((c + tl.zeros([T, T], tl.int32)) >> 1, [T, T // 2, 2])
    pair, _ = tl.split(pairs)  # [T, T / 2]: both columns of a pair hold the same c >> 1
    x = tl.cast(seed, tl.uint32, bitcast=True)
    x = x ^ (tl.cast(b, tl.uint32, bitcast=True) * 0x9E3779B1)
    x = x ^ (tl.cast(h, tl.uint32, bitcast=True) * 0x85EBCA77)
    x = x ^ (tl.cast(qi, tl.uint32, bitcast=True) * 0xC2B2AE3D)
    x = x ^ (tl.cast(pair, tl.uint32, bitcast=True) * 0x27D4EB2F)
    x = (x ^ (x >> 16)) * 0x85EBCA6B
    x = (x ^ (x >> 13)) * 0xC2B2AE35
    x = x ^ (x >> 16)
    both = tl.reshape(tl.join(x, x), [T, T])  # each pair's hash at both of its columns
    bits = tl.where((c & 1) == 1, both >> 16, both & 0xFFFF)
    return bits.to(tl.int32) >= threshold


@triton.jit
def _pos_chunk(pos_ptr, stride_pd, stride_pj, chunk, L, D, T: tl.constexpr, DP: tl.constexpr):
    """u for context columns chunk*T .. chunk*T + T - 1 as [T, DP] (zero outside 0 .. L' - 1)."""
    col = chunk * T + tl.arange(0, T)
    dd = tl.arange(0, DP)
    ok = (col[:, None] >= 0) & (col[:, None] < L) & (dd[None, :] < D)
    return tl.load(pos_ptr + col[:, None] * stride_pj + dd[None, :] * stride_pd, mask=ok, other=0.0)


@triton.jit
def _seed(seed_ptr, DROPOUT: tl.constexpr):
    """The dropout seed, read only with dropout on (without it the pointer is a stand-in)."""
    seed = 0
    if DROPOUT:
        seed = tl.load(seed_ptr)
    return seed


@triton.jit
def _key_tiles(k_base, v_base, keys, skm, svm, L, M, D, DP: tl.constexpr):
    """The keys and values of key indices ``keys`` as [T, DP] (zero past L' + M rows and d_h)."""
    dd = tl.arange(0, DP)
    ok = (keys[:, None] < L + M) & (dd[None, :] < D)
    k_tile = tl.load(k_base + keys[:, None] * skm + dd[None, :], mask=ok, other=0.0)
    v_tile = tl.load(v_base + keys[:, None] * svm + dd[None, :], mask=ok, other=0.0)
    return k_tile, v_tile


@triton.jit
def _persistent_tiles(pk_ptr, pv_ptr, h, pers, spkh, spkn, spvh, spvn, N, D, DP: tl.constexpr):
    """Head h's persistent keys and values ``pers`` as [T, DP] (zero past N and d_h)."""
    dd = tl.arange(0, DP)
    ok = (pers[:, None] < N) & (dd[None, :] < D)
    pk = tl.load(pk_ptr + h * spkh + pers[:, None] * spkn + dd[None, :], mask=ok, other=0.0)
    pv = tl.load(pv_ptr + h * spvh + pers[:, None] * spvn + dd[None, :], mask=ok, other=0.0)
    return pk, pv


@triton.jit
def _persistent_logits(q, pk, pers, N, qk_scale2, PREC: tl.constexpr):
    """s2 of a tile of persistent vectors: no position term, no mask; -inf past N."""
    s2 = tl.dot(q, tl.trans(pk), input_precision=PREC) * qk_scale2
    return tl.where(pers[None, :] < N, s2, float("-inf"))


@triton.jit
def _key_index(i0, k, T: tl.constexpr):
    """The dropout's key coordinate of window tile k's scores: the key index c = i + j (even
    at the tile's first column: i0 and T are even)."""
    return i0 + k * T + tl.arange(0, T)[None, :]


@triton.jit
def _accumulate(
    s2, mask, values, m_i, e_i, l_i, acc, seed, b, h, rows, key, threshold,
    HAS_MASK: tl.constexpr, MASKED: tl.constexpr, DROPOUT: tl.constexpr, T: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """One step of the online softmax over a tile of logits s2 (log2 units), all relative
    to the running row max m: e, the sum of exp2 over every key (kept only with a span mask:
    its eps term), l, the sum of the masked weights (dropped or not: the denominator), and
    the output accumulated from the kept masked weights. ``mask``: the tile's m (MASKED;
    persistent tiles have none). Returns (m, e, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s2, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s2 - m_new[:, None])
    if HAS_MASK:
        e_i = e_i * alpha + tl.sum(p, 1)
    if MASKED:
        p = p * mask
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(_keep(seed, b, h, rows[:, None], key, threshold, T), p, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PREC)
    return m_new, e_i, l_i, acc


@triton.jit
def _chunk_bias(q, u, chunk, L, qk_scale2, T: tl.constexpr, PREC: tl.constexpr):
    """Distance chunk ``chunk`` of one query block, in log2 units: [r, jj] = q_r . u_j / sqrt(d_h)
    for j = chunk*T + jj, and -inf where j is outside the window 0 <= j < L' (so the window's
    edges come with the gather, not as a mask of every tile)."""
    jj = chunk * T + tl.arange(0, T)
    row = tl.where((jj >= 0) & (jj < L), 0.0, float("-inf"))
    return tl.dot(q, tl.trans(u), input_precision=PREC) * qk_scale2 + row[None, :]


@triton.jit
def _window_mask(mask_row, k, L, HAS_MASK: tl.constexpr, T: tl.constexpr):
    """The span mask m(j) of window tile k's scores, j = kT + t - r ([T, T], float32; 0
    outside the window, where the logits are -inf anyway); without a mask, ones that the
    callers never read (MASKED off)."""
    mask = tl.full([T, T], 1.0, tl.float32)
    if HAS_MASK:
        j = k * T + tl.arange(0, T)[None, :] - tl.arange(0, T)[:, None]
        mask = tl.load(mask_row + j, mask=(j >= 0) & (j < L), other=0.0)
    return mask


@triton.jit
def _window_logits(q, k_tile, bias_prev, bias_cur, qk_scale2, T: tl.constexpr, PREC: tl.constexpr):
    """s2 of window tile k ([T, T], log2 units; -inf outside the window) from the biases of
    distance chunks k - 1 and k: column j = kT + t - r sits at (t - r) mod T of one of them."""
    rr = tl.arange(0, T)[:, None]
    tt = tl.arange(0, T)[None, :]
    at = (tt - rr + T) % T
    bias = tl.where(tt >= rr, tl.gather(bias_cur, at, 1), tl.gather(bias_prev, at, 1))
    return tl.dot(q, tl.trans(k_tile), input_precision=PREC) * qk_scale2 + bias


@triton.jit
def attention_fwd(
    q_ptr, k_ptr, v_ptr, pos_ptr, pk_ptr, pv_ptr, mask_ptr, seed_ptr,
    sqb, sqh, sqm, skb, skh, skm, svb, svh, svm, stride_pd, stride_pj, spkh, spkn, spvh, spvn, slh,
    B, H, M, L, N, D, qk_scale2, sm_scale, keep_scale, threshold, renorm_eps,
    out_ptr, lse_ptr, sob, soh, som,
    HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, T: tl.constexpr, DP: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """One block of T queries: out [T, d_h] and log2 of the row's denominator D plus its
    max (the backward's e / D is exp2(s2 - lse))."""
    i0 = tl.program_id(0) * T
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = i0 + tl.arange(0, T)
    cols = tl.arange(0, T)
    dd = tl.arange(0, DP)
    row_ok = rows < M
    dmask = dd[None, :] < D
    q = tl.load(
        q_ptr + b * sqb + h * sqh + rows[:, None] * sqm + dd[None, :],
        mask=row_ok[:, None] & dmask,
        other=0.0,
    )
    seed = _seed(seed_ptr, DROPOUT)
    m_i = tl.full([T], float("-inf"), tl.float32)
    e_i = tl.zeros([T], tl.float32)
    l_i = tl.zeros([T], tl.float32)
    acc = tl.zeros([T, DP], tl.float32)
    bias_prev = tl.full([T, T], float("-inf"), tl.float32)  # chunk -1: before the window
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    for k in range(0, (L + T - 2) // T + 1):  # the window's tiles
        k_tile, v_tile = _key_tiles(k_base, v_base, i0 + k * T + cols, skm, svm, L, M, D, DP)
        u = _pos_chunk(pos_ptr, stride_pd, stride_pj, k, L, D, T, DP)
        bias_cur = _chunk_bias(q, u, k, L, qk_scale2, T, PREC)
        s2 = _window_logits(q, k_tile, bias_prev, bias_cur, qk_scale2, T, PREC)
        mask = _window_mask(mask_ptr + h * slh, k, L, HAS_MASK, T)
        m_i, e_i, l_i, acc = _accumulate(
            s2, mask, v_tile, m_i, e_i, l_i, acc, seed, b, h, rows, _key_index(i0, k, T),
            threshold, HAS_MASK, HAS_MASK, DROPOUT, T, PREC,
        )  # fmt: skip
        bias_prev = bias_cur
    for n0 in range(0, N, T):
        pers = n0 + cols
        pk, pv = _persistent_tiles(pk_ptr, pv_ptr, h, pers, spkh, spkn, spvh, spvn, N, D, DP)
        s2 = _persistent_logits(q, pk, pers, N, qk_scale2, PREC)
        m_i, e_i, l_i, acc = _accumulate(
            s2, 1.0, pv, m_i, e_i, l_i, acc, seed, b, h, rows, -1 - pers[None, :], threshold,
            HAS_MASK, False, DROPOUT, T, PREC,
        )  # fmt: skip
    denominator = l_i
    if HAS_MASK:
        denominator += renorm_eps * e_i
    out = acc * (keep_scale / denominator)[:, None]
    tl.store(
        out_ptr + b * sob + h * soh + rows[:, None] * som + dd[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dmask,
    )
    tl.store(lse_ptr + bh * M + rows, m_i + tl.math.log2(denominator), mask=row_ok)


@triton.jit
def _bwd_rows(
    q_ptr, do_ptr, lse_ptr, delta_ptr, b, h, bh, rows, sqb, sqh, sqm, sdob, sdoh, sdom, M, D,
    DP: tl.constexpr,
):  # fmt: skip
    """A query block's q, dO, log-sum-exp and delta; rows past M read as zeros, so every
    gradient they would touch gets exactly 0 (their dS is P * (0 - 0))."""
    dd = tl.arange(0, DP)
    ok = (rows[:, None] < M) & (dd[None, :] < D)
    q = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None] * sqm + dd[None, :], mask=ok, other=0.0)
    do = tl.load(
        do_ptr + b * sdob + h * sdoh + rows[:, None] * sdom + dd[None, :], mask=ok, other=0.0
    )
    lse = tl.load(lse_ptr + bh * M + rows, mask=rows < M, other=0.0)
    delta = tl.load(delta_ptr + bh * M + rows, mask=rows < M, other=0.0)
    return q, do, lse, delta


@triton.jit
def _scores_grad(
    s2, mask, lse, delta, do, v_tile, seed, b, h, rows, key, threshold, keep_scale, renorm_eps,
    HAS_MASK: tl.constexpr, MASKED: tl.constexpr, DROPOUT: tl.constexpr, T: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """One tile's weights after dropout (what multiplied the values), dS = dL/ds and dm =
    dL/dm (meaningful for MASKED tiles), from its logits s2 and its mask (MASKED); ``key``:
    the dropout's key coordinate of each column."""
    e = tl.math.exp2(s2 - lse[:, None])  # e / D: at most 1 / eps
    p = e
    if MASKED:
        p = e * mask
    dp = tl.dot(do, tl.trans(v_tile), input_precision=PREC)
    if DROPOUT:
        keep = _keep(seed, b, h, rows[:, None], key, threshold, T)
        dp = tl.where(keep, dp * keep_scale, 0.0)
        p_dropped = tl.where(keep, p * keep_scale, 0.0)
    else:
        p_dropped = p
    dp_centred = dp - delta[:, None]
    ds = p * dp_centred
    if HAS_MASK:
        ds -= (renorm_eps * delta)[:, None] * e  # every key's share of the eps term
    return p_dropped, ds, e * dp_centred


@triton.jit
def _window_tile_grad(
    q, do, lse, delta, k_tile, v_tile, u_prev, u, mask_row, i0, k, L, qk_scale2, seed, b, h,
    rows, threshold, keep_scale, renorm_eps, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
    T: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Window tile k of one query block, recomputed for the backward from u's chunks k - 1
    and k: (its weights after dropout, dS, dm)."""
    bias_prev = _chunk_bias(q, u_prev, k - 1, L, qk_scale2, T, PREC)
    bias_cur = _chunk_bias(q, u, k, L, qk_scale2, T, PREC)
    s2 = _window_logits(q, k_tile, bias_prev, bias_cur, qk_scale2, T, PREC)
    mask = _window_mask(mask_row, k, L, HAS_MASK, T)
    return _scores_grad(
        s2, mask, lse, delta, do, v_tile, seed, b, h, rows, _key_index(i0, k, T), threshold,
        keep_scale, renorm_eps, HAS_MASK, HAS_MASK, DROPOUT, T, PREC,
    )  # fmt: skip


@triton.jit
def attention_bwd_dq(
    q_ptr, k_ptr, v_ptr, pos_ptr, pk_ptr, pv_ptr, mask_ptr, seed_ptr,
    sqb, sqh, sqm, skb, skh, skm, svb, svh, svm, stride_pd, stride_pj, spkh, spkn, spvh, spvn, slh,
    B, H, M, L, N, D, qk_scale2, sm_scale, keep_scale, threshold, renorm_eps,
    do_ptr, lse_ptr, delta_ptr, sdob, sdoh, sdom, dq_ptr, du_ptr, dmask_ptr, W,
    HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, T: tl.constexpr, DP: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """One block of T queries: dq, and this block's partial sums of
    q^T dS and of dm per distance (u's and m's gradients, reduced by the caller):
    du [B * H, blocks, W, d_h] and dmask [B * H, blocks, W], W >= L' + T - 1."""
    blk = tl.program_id(0)
    i0 = blk * T
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = i0 + tl.arange(0, T)
    cols = tl.arange(0, T)
    rr = tl.arange(0, T)[:, None]
    dd = tl.arange(0, DP)
    dmask = dd[None, :] < D
    q, do, lse, delta = _bwd_rows(
        q_ptr, do_ptr, lse_ptr, delta_ptr, b, h, bh, rows, sqb, sqh, sqm, sdob, sdoh, sdom, M, D, DP
    )
    seed = _seed(seed_ptr, DROPOUT)
    dq = tl.zeros([T, DP], tl.float32)
    u_prev = tl.zeros([T, DP], q.dtype)
    # distance chunk k - 1's part of dS from tile k - 1 (the input dtype: it only meets
    # matmuls), and of dm's column sums (m's gradient, float32)
    d_carry = tl.zeros([T, T], q.dtype)
    sum_carry = tl.zeros([T], tl.float32)
    at = (cols[None, :] + rr) % T  # distance column jj of row r is tile column (jj + r) mod T
    later = cols[None, :] + rr < T  # ... of this tile's chunk k (else of chunk k - 1)
    part = (bh * tl.num_programs(0) + blk).to(tl.int64)
    du_base = du_ptr + part * W * D
    dmask_base = dmask_ptr + part * W
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    mask_row = mask_ptr + h * slh
    for k in range(0, (L + T - 2) // T + 1):
        k_tile, v_tile = _key_tiles(k_base, v_base, i0 + k * T + cols, skm, svm, L, M, D, DP)
        u = _pos_chunk(pos_ptr, stride_pd, stride_pj, k, L, D, T, DP)
        # chunk k - 1's bias recomputed from the u kept for dq, not carried ([T, T] float32)
        _, ds, dm = _window_tile_grad(
            q, do, lse, delta, k_tile, v_tile, u_prev, u, mask_row, i0, k, L, qk_scale2, seed,
            b, h, rows, threshold, keep_scale, renorm_eps, HAS_MASK, DROPOUT, T, PREC,
        )  # fmt: skip
        dq += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=PREC)
        by_distance = tl.gather(ds, at, 1)
        earlier = tl.where(later, 0.0, by_distance)
        d_done = d_carry + earlier.to(q.dtype)  # chunk k - 1, now complete (disjoint parts)
        dq += tl.dot(d_done, u_prev, input_precision=PREC)
        done_sums = sum_carry
        if HAS_MASK:
            dm_by_distance = tl.gather(dm, at, 1)
            done_sums += tl.sum(tl.where(later, 0.0, dm_by_distance), 0)
            sum_carry = tl.sum(tl.where(later, dm_by_distance, 0.0), 0)
        _store_chunk(du_base, dmask_base, k - 1, d_done, done_sums, q, D, T, DP, PREC)
        d_carry = tl.where(later, by_distance, 0.0).to(q.dtype)
        u_prev = u
    dq += tl.dot(d_carry, u_prev, input_precision=PREC)
    _store_chunk(du_base, dmask_base, (L + T - 2) // T, d_carry, sum_carry, q, D, T, DP, PREC)
    for n0 in range(0, N, T):
        pers = n0 + cols
        pk, pv = _persistent_tiles(pk_ptr, pv_ptr, h, pers, spkh, spkn, spvh, spvn, N, D, DP)
        s2 = _persistent_logits(q, pk, pers, N, qk_scale2, PREC)
        _, ds, _ = _scores_grad(
            s2, 1.0, lse, delta, do, pv, seed, b, h, rows, -1 - pers[None, :], threshold,
            keep_scale, renorm_eps, HAS_MASK, False, DROPOUT, T, PREC,
        )  # fmt: skip
        dq += tl.dot(ds.to(pk.dtype), pk, input_precision=PREC)
    tl.store(
        dq_ptr + bh * M * D + rows[:, None] * D + dd[None, :],
        dq * sm_scale,
        mask=(rows[:, None] < M) & dmask,
    )


@triton.jit
def _store_chunk(
    du_base, dmask_base, chunk, d, dm_sums, q, D, T: tl.constexpr, DP: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """Distance chunk ``chunk``'s partial sums of one query block: dS^T q and dm's column
    sums ``dm_sums`` (nothing for chunk -1, the tile before the first)."""
    if chunk >= 0:
        jj = chunk * T + tl.arange(0, T)
        dd = tl.arange(0, DP)
        du = tl.dot(tl.trans(d), q, input_precision=PREC)
        tl.store(du_base + jj[:, None] * D + dd[None, :], du, mask=dd[None, :] < D)
        tl.store(dmask_base + jj, dm_sums)


@triton.jit
def attention_bwd_dkdv(
    q_ptr, k_ptr, v_ptr, pos_ptr, pk_ptr, pv_ptr, mask_ptr, seed_ptr,
    sqb, sqh, sqm, skb, skh, skm, svb, svh, svm, stride_pd, stride_pj, spkh, spkn, spvh, spvn, slh,
    B, H, M, L, N, D, qk_scale2, sm_scale, keep_scale, threshold, renorm_eps,
    do_ptr, lse_ptr, delta_ptr, sdob, sdoh, sdom, dk_ptr, dv_ptr,
    HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, T: tl.constexpr, DP: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """One tile of T window keys (key indices c0 .. c0 + T - 1): dk and dv,
    over the query blocks whose windows reach it (i from c - L' + 1 to c)."""
    c0 = tl.program_id(0) * T
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, T)
    dd = tl.arange(0, DP)
    dmask = dd[None, :] < D
    keys = c0 + cols
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    k_tile, v_tile = _key_tiles(k_base, v_base, keys, skm, svm, L, M, D, DP)
    seed = _seed(seed_ptr, DROPOUT)
    dk = tl.zeros([T, DP], tl.float32)
    dv = tl.zeros([T, DP], tl.float32)
    mask_row = mask_ptr + h * slh
    # query blocks from the one holding i = c0 - L' + 1 (at least 0) to the one holding c0 + T - 1
    first = tl.maximum(c0 - L + 1, 0) // T * T
    last = tl.minimum(c0 + T - 1, M - 1)
    for i0 in range(first, last + 1, T):
        rows = i0 + cols
        q, do, lse, delta = _bwd_rows(
            q_ptr, do_ptr, lse_ptr, delta_ptr, b, h, bh, rows, sqb, sqh, sqm, sdob, sdoh, sdom,
            M, D, DP,
        )  # fmt: skip
        k = (c0 - i0) // T
        u_prev = _pos_chunk(pos_ptr, stride_pd, stride_pj, k - 1, L, D, T, DP)
        u = _pos_chunk(pos_ptr, stride_pd, stride_pj, k, L, D, T, DP)
        p, ds, _ = _window_tile_grad(
            q, do, lse, delta, k_tile, v_tile, u_prev, u, mask_row, i0, k, L, qk_scale2, seed,
            b, h, rows, threshold, keep_scale, renorm_eps, HAS_MASK, DROPOUT, T, PREC,
        )  # fmt: skip
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC)
    ok = (keys[:, None] < L + M) & dmask
    tl.store(dk_ptr + bh * (L + M) * D + keys[:, None] * D + dd[None, :], dk * sm_scale, mask=ok)
    tl.store(dv_ptr + bh * (L + M) * D + keys[:, None] * D + dd[None, :], dv, mask=ok)


@triton.jit
def attention_bwd_persistent(
    q_ptr, k_ptr, v_ptr, pos_ptr, pk_ptr, pv_ptr, mask_ptr, seed_ptr,
    sqb, sqh, sqm, skb, skh, skm, svb, svh, svm, stride_pd, stride_pj, spkh, spkn, spvh, spvn, slh,
    B, H, M, L, N, D, qk_scale2, sm_scale, keep_scale, threshold, renorm_eps,
    do_ptr, lse_ptr, delta_ptr, sdob, sdoh, sdom, dpk_ptr, dpv_ptr,
    HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, T: tl.constexpr, DP: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """One tile of T persistent vectors of head h: dpk and dpv, summed over
    the whole batch and every query (the vectors are shared by the batch)."""
    n0 = tl.program_id(0) * T
    h = tl.program_id(1)
    cols = tl.arange(0, T)
    dd = tl.arange(0, DP)
    dmask = dd[None, :] < D
    pers = n0 + cols
    p_ok = (pers[:, None] < N) & dmask
    pk, pv = _persistent_tiles(pk_ptr, pv_ptr, h, pers, spkh, spkn, spvh, spvn, N, D, DP)
    seed = _seed(seed_ptr, DROPOUT)
    dpk = tl.zeros([T, DP], tl.float32)
    dpv = tl.zeros([T, DP], tl.float32)
    for b in range(0, B):
        bh = b * H + h
        for i0 in range(0, M, T):
            rows = i0 + cols
            q, do, lse, delta = _bwd_rows(
                q_ptr, do_ptr, lse_ptr, delta_ptr, b, h, bh, rows, sqb, sqh, sqm, sdob, sdoh,
                sdom, M, D, DP,
            )  # fmt: skip
            s2 = _persistent_logits(q, pk, pers, N, qk_scale2, PREC)
            p, ds, _ = _scores_grad(
                s2, 1.0, lse, delta, do, pv, seed, b, h, rows, -1 - pers[None, :], threshold,
                keep_scale, renorm_eps, HAS_MASK, False, DROPOUT, T, PREC,
            )  # fmt: skip
            dpv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
            dpk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC)
    tl.store(dpk_ptr + h * N * D + pers[:, None] * D + dd[None, :], dpk * sm_scale, mask=p_ok)
    tl.store(dpv_ptr + h * N * D + pers[:, None] * D + dd[None, :], dpv, mask=p_ok)
