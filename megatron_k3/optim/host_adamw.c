/* One-pass host AdamW for the host-streamed optimizer (megatron_k3/optim/offload.py, impl "onepass").

   Per element j of a chunk (g: the fp32 gradient chunk; master fp32; m, v: the moments, bf16 or fp32):

       g'   = g * clip                                  (only when clip != 1, as g.mul_(clip) today)
       p    = master * (1 - lr*wd)                      (only when wd != 0)
       m    = fma(w, g' - m, m)      w = 1 - beta1      (torch's vectorised lerp_, |w| < 0.5)
            = fma(w - 1, g' - m, g')                    (|w| >= 0.5)
       v    = fma(c2 * g', g', v * beta2)   c2 = 1 - beta2
       den  = sqrt(v) / sqrt(1 - beta2^t) + eps
       p    = p + (-(lr / (1 - beta1^t)) * m) / den
       out  = p cast to the parameter dtype (bf16: round to nearest even, as torch's casts)

   This is, operation for operation and rounding for rounding, what torch's fused CPU AdamW
   (torch._fused_adamw_, aten/src/ATen/native/cpu/FusedAdamKernel.cpp) computes on its vector path; the
   constants are formed in double and rounded to float as there. The difference from the stream's "fused"
   impl is the memory traffic: that one upcasts bf16 moments into fp32 working copies, runs the fused
   kernel, copies the moments back and casts the outputs (about seven passes and seven thread-pool
   rounds per cache block); this reads g, master, m, v once and writes master, m, v and the output once
   (22 bytes a parameter with bf16 moments and a bf16 output), one OpenMP round per chunk.

   Built with -ffp-contract=off: every fma above is written out, nothing else is contracted, so the
   compiler's vectorisation does not change a bit (sqrt and division are IEEE-exact). The loader
   (host_kernel.py) checks the bits against torch._fused_adamw_ before the stream uses it.

   pieces: n rows of int64 {a, z, group, out_kind, out_ptr}: host elements [a, z) (absolute offsets into
   master/m/v; g is indexed from h0), their (lr, wd) group, and where their updated weights go
   (out_kind 0: fp32, 1: bf16, 2: no output; out_ptr: the address of element a's output). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* c10::BFloat16's round_to_nearest_even */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

typedef struct {
    float clip, wdf, w, b2, c2, bc2s, eps, nss;
    int do_clip, do_wd, small_w;
} consts_t;

/* the element loop, specialised by the inliner for each (moments, output) kind */
static inline __attribute__((always_inline)) void
run(int mbf16, int okind, int64_t x, int64_t y, const float *g, float *master, void *mv, void *vv, void *out,
    const consts_t *k) {
    const float clip = k->clip, wdf = k->wdf, w = k->w, b2 = k->b2, c2 = k->c2, bc2s = k->bc2s, eps = k->eps,
                nss = k->nss, wm1 = k->w - 1.0f;
    const int do_clip = k->do_clip, do_wd = k->do_wd, small_w = k->small_w;
    uint16_t *mb = (uint16_t *)mv + x, *vb = (uint16_t *)vv + x;
    float *mf = (float *)mv + x, *vf = (float *)vv + x, *p = master + x;
    float *of = (float *)out;
    uint16_t *ob = (uint16_t *)out;
    const int64_t n = y - x;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        if (do_clip) gi = gi * clip;
        float pi = p[i];
        if (do_wd) pi = pi * wdf;
        float mi = mbf16 ? bf16_to_f32(mb[i]) : mf[i];
        float vi = mbf16 ? bf16_to_f32(vb[i]) : vf[i];
        mi = small_w ? fmaf(w, gi - mi, mi) : fmaf(wm1, gi - mi, gi);
        vi = fmaf(c2 * gi, gi, vi * b2);
        float den = sqrtf(vi) / bc2s + eps;
        pi = pi + (nss * mi) / den;
        p[i] = pi;
        if (mbf16) { mb[i] = f32_to_bf16(mi); vb[i] = f32_to_bf16(vi); }
        else { mf[i] = mi; vf[i] = vi; }
        if (okind == 0) of[i] = pi;
        else if (okind == 1) ob[i] = f32_to_bf16(pi);
    }
}

static void piece(int mbf16, int okind, int64_t x, int64_t y, const float *g, float *master, void *m, void *v,
                  void *out, const consts_t *k) {
    if (mbf16) {
        if (okind == 0) run(1, 0, x, y, g, master, m, v, out, k);
        else if (okind == 1) run(1, 1, x, y, g, master, m, v, out, k);
        else run(1, 2, x, y, g, master, m, v, out, k);
    } else {
        if (okind == 0) run(0, 0, x, y, g, master, m, v, out, k);
        else if (okind == 1) run(0, 1, x, y, g, master, m, v, out, k);
        else run(0, 2, x, y, g, master, m, v, out, k);
    }
}

/* AdamW step `step` over the pieces of one chunk [h0, h1); hyper: (lr, wd) per group as doubles.
   Returns 0, or -1 for an unknown output kind. */
int k3_adamw_chunk(const int64_t *pieces, int64_t npieces, int64_t h0, int64_t h1, const float *g, float *master,
                   void *m, void *v, int mbf16, const double *hyper, double step, double beta1, double beta2,
                   double eps, double clip, int nthreads) {
    for (int64_t i = 0; i < npieces; i++)
        if (pieces[5 * i + 3] < 0 || pieces[5 * i + 3] > 2) return -1;
    const double bc1 = 1.0 - pow(beta1, step), bc2 = 1.0 - pow(beta2, step);
    const int64_t len = h1 - h0;
    if (nthreads < 1) nthreads = 1;
    /* each thread a contiguous, 16-element aligned share of the chunk (cache lines not shared) */
    int64_t per = (len + nthreads - 1) / nthreads;
    per = (per + 15) & ~(int64_t)15;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t r0 = h0 + per * omp_get_thread_num();
        const int64_t r1 = r0 + per < h1 ? r0 + per : h1;
        for (int64_t i = 0; i < npieces && r0 < r1; i++) {
            const int64_t *pc = pieces + 5 * i;
            const int64_t a = pc[0], z = pc[1];
            const int64_t x = a > r0 ? a : r0, y = z < r1 ? z : r1;
            if (y <= x) continue;
            const double lr = hyper[2 * pc[2]], wd = hyper[2 * pc[2] + 1];
            consts_t k;
            k.clip = (float)clip;
            k.do_clip = clip != 1.0;
            k.wdf = (float)(1.0 - lr * wd);
            k.do_wd = wd != 0.0;
            k.w = (float)(1.0 - beta1);
            k.small_w = fabsf(k.w) < 0.5f;
            k.b2 = (float)beta2;
            k.c2 = (float)(1.0 - beta2);
            k.bc2s = (float)sqrt(bc2);
            k.eps = (float)eps;
            k.nss = (float)(-(lr / bc1));
            char *out = (char *)(intptr_t)pc[4];
            const int osz = pc[3] == 0 ? 4 : 2;
            piece(mbf16, (int)pc[3], x, y, g + (x - h0), master, m, v, out ? out + osz * (x - a) : 0, &k);
        }
    }
    return 0;
}
