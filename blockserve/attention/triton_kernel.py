"""The Triton kernel of the `triton` attention backend (launched by triton_paged.py, which imports
this module, and with it Triton, only when the backend first runs).

One program handles a tile of up to BLOCK_Q consecutive query rows of one sequence for a block
of G_BLOCK query heads that share one KV head, as the rows of one matrix:

    tile rows   r = qi * G_BLOCK + g      query row (tile start + qi), head kv_head * G + g
    keys        positions lo..hi in steps of BLOCK_N (any number of pages: each key's page is
                looked up in the block table), one step of an online softmax each (fp32
                accumulators); lo = the first key any row of the tile sees (key_start, or the
                window), hi = the tile's last position
    loads       every table and K/V load is masked to positions [lo, hi]: a slot at or past
                seq_len (never written) is not read, so reads_unwritten_slots = False (C1)

Keys may come in two parts (`q2`/`k2`, dot products added): MLA's absorbed form scores a head
as [q_lat | q_rope] . [c | k_rope] over the latent cache row, and its values are the row's
first part (VALUE_IS_K1: the loaded tile is reused, not read twice). A quantized latent row
(attention/latent_quant.py) gives each part its own scale, side by side (K2_CODES: k2's form,
its scale the one after k1's); its values share k1's codes and scale (V_CODES = K_CODES).

Quantized caches (attention/kv_quant.py; K_CODES / V_CODES, each side on its own: 0 plain, 1
int8 codes, 2 rotated 4-bit codes two a byte, low nibble first, 3 e4m3 codes read as bytes and
bitcast): the code pointer is the cache itself (a row's first bytes), the scale pointer a float16
view of each row's tail
(scale; 4-bit: then minimum). Codes are read in place and widened in registers; each key's scale is
folded into its score and each value's into its softmax weight, one multiply per key:

    score  = (q . c_k) * scale_k  (+ minimum_k * sum_d q_d, 4-bit)
    output = sum_k (p_k * scale_k) c_k  (+ sum_k p_k * minimum_k, 4-bit), all in float32 with fp32 inputs

(4-bit: c the codes' levels, kv_quant.INT4_LEVELS, selected in registers by `_int4_level`.)

A 4-bit cache holds rotated vectors: the caller passes rotated queries and un-rotates the output.
Scale loads are masked as the code loads are, so a poisoned row (NaN scale) is never read.

Sinks (HAS_SINKS, GPT-OSS): head h's learned logit sinks[h] joins each row's softmax denominator
(as exp2(sink · log2 e - m) in the running maximum's frame) and weighs no value; with key splits,
COMBINE adds it once, in the frame of the splits' largest log2-sum-exp.

Split keys (flash-decoding, decode-only steps): with SPLITS > 1 the grid's third axis also splits
each row's key steps into SPLITS shares; each program stores its share's normalised output and
log2-sum-exp (fp32, [tokens, query heads, SPLITS]) and `COMBINE` weighs them into the output. So a
small batch of long contexts keeps the GPU's multiprocessors busy.

With TRITON_INTERPRET=1 in the environment before Triton is first imported, `KERNEL` runs in
Triton's interpreter (numpy, on CPU tensors: for tests); Triton binds its library functions to one
mode at import, so a process runs kernels one way only.
"""

import triton
import triton.language as tl


LOG2E = 1.4426950408889634


@triton.jit
def _int4_level(c):
    """4-bit codes c (integers in [0, 16)) as their levels, kv_quant.INT4_LEVELS (64ths), float32:
    a tree of selects on the code's bits, no table in memory."""
    low = tl.where(c < 4, tl.where(c < 2, tl.where(c < 1, 0.0, 93.0), tl.where(c < 3, 168.0, 233.0)),
                   tl.where(c < 6, tl.where(c < 5, 292.0, 348.0), tl.where(c < 7, 401.0, 454.0)))
    high = tl.where(c < 12, tl.where(c < 10, tl.where(c < 9, 506.0, 559.0), tl.where(c < 11, 612.0, 668.0)),
                    tl.where(c < 14, tl.where(c < 13, 727.0, 792.0), tl.where(c < 15, 867.0, 960.0)))
    return tl.where(c < 8, low, high) * (1.0 / 64)


def _kernel(
    out_ptr, part_out_ptr, part_lse_ptr, q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, sinks_ptr, ks_ptr, vs_ptr,
    table_ptr, seq_len_ptr, key_start_ptr, query_start_ptr, tile_seq_ptr, tile_row_ptr,
    scale_log2e, window,
    stride_ot, stride_oh, stride_q1t, stride_q1h, stride_q2t, stride_q2h,
    stride_k1p, stride_k1s, stride_k1h, stride_k2p, stride_k2s, stride_k2h,
    stride_vp, stride_vs, stride_vh, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    stride_table,
    G: tl.constexpr, G_BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    D1: tl.constexpr, D1_PAD: tl.constexpr, D2: tl.constexpr, D2_PAD: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr, VALUE_IS_K1: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr = False, K_CODES: tl.constexpr = 0, V_CODES: tl.constexpr = 0, K2_CODES: tl.constexpr = 0,
):
    """Program (tile, KV head, head block x split): see the module docstring."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    head_block = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    seq = tl.load(tile_seq_ptr + tile)
    if seq >= 0:
        row0 = tl.load(tile_row_ptr + tile)
        q_start = tl.load(query_start_ptr + seq)
        q_end = tl.load(query_start_ptr + seq + 1)
        seq_len = tl.load(seq_len_ptr + seq)
        first_pos = seq_len - (q_end - q_start) + (row0 - q_start)  # position of the tile's first row
        tile_len = tl.minimum(q_end - row0, BLOCK_Q)

        r = tl.arange(0, BLOCK_M)
        qi = r // G_BLOCK
        g = head_block * G_BLOCK + r % G_BLOCK
        row_ok = (qi < tile_len) & (g < G) & (r < BLOCK_Q * G_BLOCK)
        token = (row0 + qi).to(tl.int64)
        head = (kv_head * G + g).to(tl.int64)
        pos = first_pos + qi

        d1 = tl.arange(0, D1_PAD)
        q1 = tl.load(q1_ptr + token[:, None] * stride_q1t + head[:, None] * stride_q1h + d1[None, :],
                     mask=row_ok[:, None] & (d1[None, :] < D1), other=0.0)
        if D2 > 0:
            d2 = tl.arange(0, D2_PAD)
            q2 = tl.load(q2_ptr + token[:, None] * stride_q2t + head[:, None] * stride_q2h + d2[None, :],
                         mask=row_ok[:, None] & (d2[None, :] < D2), other=0.0)
        dv = tl.arange(0, DV_PAD)
        if K_CODES == 2:  # a 4-bit key's minimum adds minimum * sum_d q_d to its score
            q_sum = tl.sum(q1.to(tl.float32), 1)
        if K_CODES == 2:  # 4-bit codes: byte d // 2, low nibble for even d
            k_col, k_shift = d1 // 2, (d1 % 2) * 4
        else:
            k_col = d1
        if V_CODES == 2:
            v_col, v_shift = dv // 2, (dv % 2) * 4
        else:
            v_col = dv

        lo = tl.load(key_start_ptr + seq)
        if HAS_WINDOW:
            lo = tl.maximum(lo, first_pos - window + 1)
        hi = first_pos + tile_len - 1
        n = tl.arange(0, BLOCK_N)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
        first_step, last_step = lo // BLOCK_N, hi // BLOCK_N
        if SPLITS > 1:  # this program's share of the key steps (none, for a short context's last splits)
            per_split = (last_step - first_step + SPLITS) // SPLITS
            first_step += split * per_split
            last_step = tl.minimum(last_step, first_step + per_split - 1)
        for start in range(first_step * BLOCK_N, (last_step + 1) * BLOCK_N, BLOCK_N):
            key_pos = start + n
            readable = (key_pos >= lo) & (key_pos <= hi)  # written slots only (C1)
            page = tl.load(table_ptr + seq * stride_table + key_pos // PAGE, mask=readable, other=0).to(tl.int64)
            slot = key_pos % PAGE
            k1 = tl.load(k1_ptr + page[:, None] * stride_k1p + slot[:, None] * stride_k1s + kv_head * stride_k1h
                         + k_col[None, :], mask=readable[:, None] & (d1[None, :] < D1), other=0)
            if K_CODES == 2:
                k1 = _int4_level((k1 >> k_shift[None, :]) & 15)
            elif K_CODES == 3:
                k1 = k1.to(tl.float8e4nv, bitcast=True)
            scores = tl.dot(q1, tl.trans(k1.to(q1.dtype)), input_precision=PRECISION)
            if K_CODES > 0:  # the key's scale (and 4-bit minimum), masked as its codes are
                k_at = ks_ptr + page * stride_ksp + slot * stride_kss + kv_head * stride_ksh
                scores = scores * tl.load(k_at, mask=readable, other=0.0).to(tl.float32)[None, :]
                if K_CODES == 2:
                    k_min = tl.load(k_at + 1, mask=readable, other=0.0).to(tl.float32)
                    scores += q_sum[:, None] * k_min[None, :]
            if D2 > 0:
                k2 = tl.load(k2_ptr + page[:, None] * stride_k2p + slot[:, None] * stride_k2s + kv_head * stride_k2h
                             + d2[None, :], mask=readable[:, None] & (d2[None, :] < D2), other=0)
                if K2_CODES == 3:
                    k2 = k2.to(tl.float8e4nv, bitcast=True)
                scores2 = tl.dot(q2, tl.trans(k2.to(q2.dtype)), input_precision=PRECISION)
                if K2_CODES > 0:  # the second part's own scale, beside the first's
                    k2_at = ks_ptr + page * stride_ksp + slot * stride_kss + kv_head * stride_ksh + 1
                    scores2 = scores2 * tl.load(k2_at, mask=readable, other=0.0).to(tl.float32)[None, :]
                scores += scores2
            visible = row_ok[:, None] & readable[None, :] & (key_pos[None, :] <= pos[:, None])
            if HAS_WINDOW:
                visible = visible & (key_pos[None, :] > pos[:, None] - window)
            scores = tl.where(visible, scores * scale_log2e, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if VALUE_IS_K1:
                values = k1
            else:
                values = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh
                                 + v_col[None, :], mask=readable[:, None] & (dv[None, :] < DV), other=0)
                if V_CODES == 2:
                    values = _int4_level((values >> v_shift[None, :]) & 15)
                elif V_CODES == 3:
                    values = values.to(tl.float8e4nv, bitcast=True)
            weights = p
            if V_CODES > 0:  # the value's scale folded into its weight
                v_at = vs_ptr + page * stride_vsp + slot * stride_vss + kv_head * stride_vsh
                weights = p * tl.load(v_at, mask=readable, other=0.0).to(tl.float32)[None, :]
            acc = acc * alpha[:, None] + tl.dot(weights.to(q1.dtype), values.to(q1.dtype), input_precision=PRECISION)
            if V_CODES == 2:  # + sum_k p_k * minimum_k in every column
                v_min = tl.load(v_at + 1, mask=readable, other=0.0).to(tl.float32)
                acc += tl.sum(p * v_min[None, :], 1)[:, None]
            m_i = m_new
        if HAS_SINKS and SPLITS == 1:  # with splits, COMBINE adds the sink
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            l_i += tl.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if SPLITS == 1:
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
        else:  # this split's normalised output and log2-sum-exp, for _combine
            part = (token * (tl.num_programs(1) * G) + head) * SPLITS + split
            tl.store(part_out_ptr + part[:, None] * DV_PAD + dv[None, :], out, mask=row_ok[:, None])
            lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))  # -inf: no key
            tl.store(part_lse_ptr + part, lse, mask=row_ok)


def _combine(out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, stride_ot, stride_oh,
             SPLITS: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    """out[token, head] = the splits' outputs weighted by their share of the softmax's sum; one
    program per (token, query head)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)
    lse = tl.load(part_lse_ptr + part)
    top = tl.max(lse, 0)  # every row sees a key (itself): some split's lse is finite
    weight = tl.exp2(lse - top)
    dv = tl.arange(0, DV_PAD)
    parts = tl.load(part_out_ptr + part[:, None] * DV_PAD + dv[None, :])
    total = tl.sum(weight, 0)
    if HAS_SINKS:
        total += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * LOG2E - top)
    out = tl.sum(parts * weight[:, None], 0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)

KERNEL = triton.jit(_kernel)
COMBINE = triton.jit(_combine)


def interpreting() -> bool:
    """Whether Triton was imported in interpreter mode."""
    return not isinstance(KERNEL, triton.runtime.JITFunction)
