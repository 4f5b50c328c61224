/* The syncer's per-value arithmetic in one pass each: norms, the round's sums, the close.
 *
 * Plain C on raw float32 / uint8 arrays (addresses from `tensor.data_ptr()`); no torch headers. Every function
 * works on a range of its arrays, so `ddiloco.kernels` can split one tensor over threads; each releases the GIL.
 * `ddiloco.kernels` owns the meaning of each function and an eager torch path that gives the same bits.
 *
 * Bit-exactness. The result of every operation here is fixed by IEEE 754 alone, whatever the instruction set:
 * built with -ffp-contract=off (no fused multiply-add: a * b + c is rounded twice, as separate torch ops round it)
 * and without -ffast-math (no reassociation). Sums of many terms follow a fixed order that does not depend on the
 * vector width or the thread count: chunks of NORM_CHUNK values, LANES running sums per chunk (value i of a chunk
 * goes to lane i % LANES), the lanes added in order, the chunks' totals added in order by the caller. The
 * functions are compiled for several x86 instruction sets (`target_clones`) and the best one is picked at load.
 */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the int4 decode assumes a little-endian host"
#endif

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define NORM_CHUNK 65536 /* values per chunk of a sum of squares; a multiple of SEGMENT */
#define LANES 16         /* running sums per chunk */
#define SEGMENT 256      /* values decoded at a time into a stack buffer (L1-resident), a multiple of LANES */
#define INT4_OFFSET 8    /* int4 code = level + 8 */
#define INT8_LEVELS 127  /* int8 levels -127..127, code = level + 128 */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define CLONED __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONED
#endif

/* Values [i0, i1) of an int4 tensor into buf[0 .. i1 - i0): (code - 8) * scale of the value's block. i0 even,
 * i1 - i0 <= SEGMENT. The codes are first spread one per byte (the low nibble of byte j to byte 2j, the high to
 * 2j + 1: a 16-bit word per byte, on a little-endian host), then widened and scaled block by block: two simple loops that
 * vectorise, where one loop writing even and odd values in turn does not. */
static inline void decode_int4(float *buf, const float *scales, const uint8_t *codes, int64_t block, int64_t i0,
                               int64_t i1) {
    uint16_t words[SEGMENT / 2 + 1];
    const uint8_t *spread = (const uint8_t *)words; /* little-endian: byte 2j is word j's low byte */
    const uint8_t *c = codes + (i0 >> 1);
    int64_t bytes = (i1 - i0 + 1) >> 1;
    for (int64_t j = 0; j < bytes; j++) words[j] = (uint16_t)((c[j] & 15) | ((c[j] >> 4) << 8));
    int64_t b = i0 / block; /* one division per segment: per block, it costs as much as the block's decode */
    int64_t i = i0;
    while (i < i1) {
        int64_t end = (b + 1) * block < i1 ? (b + 1) * block : i1;
        const float s = scales[b++];
        for (int64_t k = i - i0; k < end - i0; k++) buf[k] = (float)((int)spread[k] - INT4_OFFSET) * s;
        i = end;
    }
}

/* lanes[j] += x[k]^2 for k % LANES == j, k < count; count a multiple of LANES. Squares of float32 values are exact
 * in float64 (48 significant bits), so only the additions round. */
static inline void add_squares(double *lanes, const float *x, int64_t count) {
    for (int64_t k = 0; k < count; k += LANES)
        for (int j = 0; j < LANES; j++) {
            double v = (double)x[k + j];
            lanes[j] += v * v;
        }
}

static inline double lane_total(const double *lanes) {
    double total = lanes[0];
    for (int j = 1; j < LANES; j++) total += lanes[j];
    return total;
}

/* The sum of squares of chunk c of n values, segment by segment through `fill` into a zero-padded buffer. */
#define CHUNK_SQUARES(FILL)                                                      \
    for (int64_t c = c0; c < c1; c++) {                                          \
        double lanes[LANES] = {0};                                               \
        int64_t start = c * NORM_CHUNK;                                          \
        int64_t stop = start + NORM_CHUNK < n ? start + NORM_CHUNK : n;          \
        for (int64_t i = start; i < stop; i += SEGMENT) {                        \
            int64_t len = stop - i < SEGMENT ? stop - i : SEGMENT;               \
            int64_t padded = (len + LANES - 1) / LANES * LANES;                  \
            FILL;                                                                \
            for (int64_t k = len; k < padded; k++) buf[k] = 0.0f;                \
            add_squares(lanes, buf, padded);                                     \
        }                                                                        \
        out[c - c0] = lane_total(lanes);                                         \
    }

CLONED static void square_sums_f32(const float *x, int64_t n, int64_t c0, int64_t c1, double *out) {
    float buf[SEGMENT];
    CHUNK_SQUARES(memcpy(buf, x + i, (size_t)len * sizeof(float)))
}

CLONED static void square_sums_int4(const float *scales, const uint8_t *codes, int64_t n, int64_t block, int64_t c0,
                                    int64_t c1, double *out) {
    float buf[SEGMENT];
    CHUNK_SQUARES(decode_int4(buf, scales, codes, block, i, i + len))
}

/* acc[i] = x[i] * alpha (first) or acc[i] + x[i] * alpha, for i in [0, count): two roundings, as torch's
 * `acc.add_(x * alpha)`. */
static inline void scaled_add(float *acc, const float *x, int64_t count, float alpha, int first) {
    if (first)
        for (int64_t i = 0; i < count; i++) acc[i] = x[i] * alpha;
    else
        for (int64_t i = 0; i < count; i++) {
            float t = x[i] * alpha;
            acc[i] = acc[i] + t;
        }
}

CLONED static void accumulate_f32(float *acc, const float *x, int64_t i0, int64_t i1, float alpha, int first) {
    scaled_add(acc + i0, x + i0, i1 - i0, alpha, first);
}

CLONED static void accumulate_int4(float *acc, const float *scales, const uint8_t *codes, int64_t block, int64_t i0,
                                   int64_t i1, float alpha, int first) {
    float buf[SEGMENT];
    for (int64_t i = i0; i < i1; i += SEGMENT) {
        int64_t len = i1 - i < SEGMENT ? i1 - i : SEGMENT;
        decode_int4(buf, scales, codes, block, i, i + len);
        scaled_add(acc + i, buf, len, alpha, first);
    }
}

/* x[i] = x[i] * factor, or x[i] / factor (`divide`), over [i0, i1): one rounding each, as torch's mul_ and div_ by a
 * scalar (rounded to float32 first) give. */
CLONED static void scale_f32(float *x, int64_t i0, int64_t i1, float factor, int divide) {
    if (divide)
        for (int64_t i = i0; i < i1; i++) x[i] = x[i] / factor;
    else
        for (int64_t i = i0; i < i1; i++) x[i] = x[i] * factor;
}

/* LANES float32 (int32) values, as one vector where the instruction set has one: GCC's vector extensions, which
 * lower to whatever registers the target has, with IEEE semantics per element. */
typedef float lanes_f __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t lanes_i __attribute__((vector_size(LANES * sizeof(int32_t))));

/* The outer step and the downlink change of value i (see `ddiloco.kernels.nesterov_int8`). */
typedef struct {
    float momentum; /* m' (0 when mu = 0) */
    float stepped;  /* p' */
    float change;   /* (p' - p) + r */
} Step;

static inline Step step_change(const float *g, const float *m, const float *p, const float *r, int64_t i, float lr,
                               float mu, int first) {
    Step s = {0.0f, 0.0f, 0.0f};
    float update = g[i];
    if (mu != 0.0f) {
        s.momentum = first ? g[i] : m[i] * mu + g[i];
        update = g[i] + s.momentum * mu;
    }
    s.stepped = p[i] - update * lr;
    s.change = (s.stepped - p[i]) + r[i];
    return s;
}

/* max |x[k]| over k < len, for finite values (the close's outputs, checked finite before they are written). */
static inline float absmax_finite(const float *x, int64_t len) {
    lanes_f high = {0};
    int64_t k = 0;
    for (; k + LANES <= len; k += LANES) {
        lanes_f a;
        memcpy(&a, x + k, sizeof a);
        a = (lanes_f)((lanes_i)a & 0x7fffffff);
        lanes_i greater = a > high;
        high = (lanes_f)(((lanes_i)a & greater) | ((lanes_i)high & ~greater));
    }
    float result = 0.0f;
    for (int j = 0; j < LANES; j++) result = high[j] > result ? high[j] : result;
    for (; k < len; k++) result = fabsf(x[k]) > result ? fabsf(x[k]) : result;
    return result;
}

/* The close of one tensor, blocks [b0, b1) of `block` values (n in all): the outer Nesterov step and the int8
 * downlink change, with g the merged pseudo-gradient, m the momentum (unused when mu = 0), p the global value, r
 * the downlink's residual. `check`: write nothing, return 1 | 2 when a new momentum or parameter (1) or a change (2)
 * is not finite, else 0. Otherwise write m, p, r and the blocks' scales and codes, raise maxima[0..2] to the largest
 * |m|, |p|, |r| written, and return the first block whose change is not finite (that block and the later ones
 * unwritten), or -1. */
CLONED static int64_t nesterov_int8(const float *g, float *m, float *p, float *r, float *scales, uint8_t *codes,
                                    int64_t n, int64_t block, float lr, float mu, int first, int check, int64_t b0,
                                    int64_t b1, float *maxima) {
    int64_t flags = 0;
    for (int64_t b = b0; b < b1; b++) {
        int64_t i0 = b * block, i1 = i0 + block < n ? i0 + block : n;
        /* Pass 1 over the block (it stays in cache): the largest change, and whether anything is not finite
         * (x - x is NaN exactly when x is not). LANES running values each, so that the loop vectorises; a max and
         * a NaN test do not depend on the order. */
        lanes_f high = {0}, bad = {0}, bad_step = {0};
        int64_t i = i0;
        for (; i + LANES <= i1; i += LANES) {
            float changes[LANES], steps[LANES];
            for (int j = 0; j < LANES; j++) {
                Step s = step_change(g, m, p, r, i + j, lr, mu, first);
                changes[j] = s.change;
                steps[j] = (s.momentum - s.momentum) + (s.stepped - s.stepped);
            }
            lanes_f a, stepv;
            memcpy(&a, changes, sizeof a);
            memcpy(&stepv, steps, sizeof stepv);
            a = (lanes_f)((lanes_i)a & 0x7fffffff); /* |change| */
            bad += a - a;
            bad_step += stepv;
            lanes_i greater = a > high;
            high = (lanes_f)(((lanes_i)a & greater) | ((lanes_i)high & ~greater));
        }
        float high_all = 0.0f, bad_all = 0.0f, bad_step_all = 0.0f;
        for (int j = 0; j < LANES; j++) {
            high_all = high[j] > high_all ? high[j] : high_all;
            bad_all += bad[j];
            bad_step_all += bad_step[j];
        }
        for (; i < i1; i++) {
            Step s = step_change(g, m, p, r, i, lr, mu, first);
            float a = fabsf(s.change);
            bad_all += a - a;
            bad_step_all += (s.momentum - s.momentum) + (s.stepped - s.stepped);
            high_all = a > high_all ? a : high_all;
        }
        if (check) {
            flags |= (bad_step_all != bad_step_all ? 1 : 0) | (bad_all != bad_all ? 2 : 0);
            continue;
        }
        if (bad_all != bad_all) return b;
        const float scale = high_all / (float)INT8_LEVELS;
        const float divisor = scale > 0.0f ? scale : 1.0f;
        for (i = i0; i < i1; i++) {
            Step s = step_change(g, m, p, r, i, lr, mu, first);
            float level = rintf(s.change / divisor);
            level = level > INT8_LEVELS ? INT8_LEVELS : (level < -INT8_LEVELS ? -INT8_LEVELS : level);
            float decoded = (level + 0.0f) * scale; /* + 0.0f: a level of -0 decodes to +0, as the codec's does */
            if (mu != 0.0f) m[i] = s.momentum;
            codes[i] = (uint8_t)((int)level + 128);
            p[i] = p[i] + decoded;
            r[i] = s.change - decoded;
        }
        scales[b] = scale;
        float m_high = mu != 0.0f ? absmax_finite(m + i0, i1 - i0) : 0.0f;
        float p_high = absmax_finite(p + i0, i1 - i0), r_high = absmax_finite(r + i0, i1 - i0);
        maxima[0] = m_high > maxima[0] ? m_high : maxima[0];
        maxima[1] = p_high > maxima[1] ? p_high : maxima[1];
        maxima[2] = r_high > maxima[2] ? r_high : maxima[2];
    }
    return check ? flags : -1;
}

/* ---- CRC-32 (zlib's: reflected polynomial 0xEDB88320, initial and final inversion), for `ddiloco.checksums`.
 *
 * With PCLMULQDQ: the message is folded 64 bytes at a time into four 128-bit registers, each congruent modulo P to
 * the part of the message it has taken in. A register R (bits j = coefficient of x^(127 - j): the bytes as they lie,
 * little-endian) is split into H (x^127..x^64) and L (x^63..x^0); moving it D bits on, R x^D = H x^(D+64) + L x^D is
 * congruent to H (x^(D+63) mod P) x + L (x^(D-1) mod P) x, and a carry-less product of two reflected 64-bit values
 * is the reflected 128-bit product times x: the constants are x^(D+63) and x^(D-1) mod P. The four registers are
 * then folded into one, 16-byte blocks after it, and that register, congruent to the whole message so far, goes
 * through the byte-wise CRC like 16 message bytes (R x^32 mod P is the CRC state of the message). The initial
 * state enters as an XOR into the first four bytes. Without PCLMULQDQ: the byte-wise CRC, table-driven. */

#define CRC_POLY 0xEDB88320u

static uint32_t crc_table[256];
static uint64_t fold_512[2], fold_384[2], fold_256[2], fold_128[2];

/* x^k mod P, reflected (bit 31 is the coefficient of x^0). */
static uint32_t x_to_the(int k) {
    uint32_t v = 1u << 31;
    for (int i = 0; i < k; i++) v = (v >> 1) ^ ((v & 1) ? CRC_POLY : 0);
    return v;
}

static void crc_init(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int i = 0; i < 8; i++) c = (c >> 1) ^ ((c & 1) ? CRC_POLY : 0);
        crc_table[b] = c;
    }
    /* (for the low qword, H; for the high qword, L), each as a reflected 64-bit value: the 32-bit one shifted up */
    int distances[4] = {512, 384, 256, 128};
    uint64_t *constants[4] = {fold_512, fold_384, fold_256, fold_128};
    for (int i = 0; i < 4; i++) {
        constants[i][0] = (uint64_t)x_to_the(distances[i] + 63) << 32;
        constants[i][1] = (uint64_t)x_to_the(distances[i] - 1) << 32;
    }
}

static uint32_t crc_bytewise(uint32_t state, const uint8_t *data, int64_t n) {
    for (int64_t i = 0; i < n; i++) state = crc_table[(state ^ data[i]) & 0xFF] ^ (state >> 8);
    return state;
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_CLMUL_PATH 1

__attribute__((target("pclmul,sse4.1"))) static inline __m128i fold(__m128i x, __m128i k, __m128i next) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_clmul(uint32_t state, const uint8_t *data, int64_t n) {
    const __m128i k512 = _mm_loadu_si128((const __m128i *)fold_512), k384 = _mm_loadu_si128((const __m128i *)fold_384);
    const __m128i k256 = _mm_loadu_si128((const __m128i *)fold_256), k128 = _mm_loadu_si128((const __m128i *)fold_128);
    __m128i x0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)data), _mm_cvtsi32_si128((int)state));
    __m128i x1 = _mm_loadu_si128((const __m128i *)(data + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(data + 32));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(data + 48));
    int64_t at = 64;
    for (; at + 64 <= n; at += 64) {
        x0 = fold(x0, k512, _mm_loadu_si128((const __m128i *)(data + at)));
        x1 = fold(x1, k512, _mm_loadu_si128((const __m128i *)(data + at + 16)));
        x2 = fold(x2, k512, _mm_loadu_si128((const __m128i *)(data + at + 32)));
        x3 = fold(x3, k512, _mm_loadu_si128((const __m128i *)(data + at + 48)));
    }
    __m128i x = fold(x0, k384, fold(x1, k256, fold(x2, k128, x3)));
    for (; at + 16 <= n; at += 16) x = fold(x, k128, _mm_loadu_si128((const __m128i *)(data + at)));
    uint8_t reduced[16];
    _mm_storeu_si128((__m128i *)reduced, x);
    return crc_bytewise(crc_bytewise(0, reduced, 16), data + at, n - at);
}
#endif

/* zlib.crc32(data[:n], crc). */
static uint32_t crc32_bytes(uint32_t crc, const uint8_t *data, int64_t n) {
    uint32_t state = ~crc;
#ifdef HAVE_CLMUL_PATH
    if (n >= 64 && __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"))
        return ~crc_clmul(state, data, n);
#endif
    return ~crc_bytewise(state, data, n);
}

/* ---- Python bindings: addresses and counts in, the GIL released around the loops. ---- */

#define ADDRESS(v) ((void *)(uintptr_t)(v))

static PyObject *py_square_sums_f32(PyObject *self, PyObject *args) {
    unsigned long long x, out;
    long long n, c0, c1;
    if (!PyArg_ParseTuple(args, "KLLLK", &x, &n, &c0, &c1, &out)) return NULL;
    Py_BEGIN_ALLOW_THREADS square_sums_f32(ADDRESS(x), n, c0, c1, ADDRESS(out));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_square_sums_int4(PyObject *self, PyObject *args) {
    unsigned long long scales, codes, out;
    long long n, block, c0, c1;
    if (!PyArg_ParseTuple(args, "KKLLLLK", &scales, &codes, &n, &block, &c0, &c1, &out)) return NULL;
    Py_BEGIN_ALLOW_THREADS square_sums_int4(ADDRESS(scales), ADDRESS(codes), n, block, c0, c1, ADDRESS(out));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_accumulate_f32(PyObject *self, PyObject *args) {
    unsigned long long acc, x;
    long long i0, i1;
    float alpha;
    int first;
    if (!PyArg_ParseTuple(args, "KKLLfp", &acc, &x, &i0, &i1, &alpha, &first)) return NULL;
    Py_BEGIN_ALLOW_THREADS accumulate_f32(ADDRESS(acc), ADDRESS(x), i0, i1, alpha, first);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_accumulate_int4(PyObject *self, PyObject *args) {
    unsigned long long acc, scales, codes;
    long long block, i0, i1;
    float alpha;
    int first;
    if (!PyArg_ParseTuple(args, "KKKLLLfp", &acc, &scales, &codes, &block, &i0, &i1, &alpha, &first)) return NULL;
    Py_BEGIN_ALLOW_THREADS accumulate_int4(ADDRESS(acc), ADDRESS(scales), ADDRESS(codes), block, i0, i1, alpha,
                                           first);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_scale_f32(PyObject *self, PyObject *args) {
    unsigned long long x;
    long long i0, i1;
    float factor;
    int divide;
    if (!PyArg_ParseTuple(args, "KLLfp", &x, &i0, &i1, &factor, &divide)) return NULL;
    Py_BEGIN_ALLOW_THREADS scale_f32(ADDRESS(x), i0, i1, factor, divide);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_nesterov_int8(PyObject *self, PyObject *args) {
    unsigned long long g, m, p, r, scales, codes, maxima;
    long long n, block, b0, b1;
    float lr, mu;
    int first, check;
    int64_t result;
    if (!PyArg_ParseTuple(args, "KKKKKKLLffppLLK", &g, &m, &p, &r, &scales, &codes, &n, &block, &lr, &mu, &first,
                          &check, &b0, &b1, &maxima))
        return NULL;
    Py_BEGIN_ALLOW_THREADS result = nesterov_int8(ADDRESS(g), ADDRESS(m), ADDRESS(p), ADDRESS(r), ADDRESS(scales),
                                                  ADDRESS(codes), n, block, lr, mu, first, check, b0, b1,
                                                  ADDRESS(maxima));
    Py_END_ALLOW_THREADS return PyLong_FromLongLong(result);
}

static PyObject *py_crc32(PyObject *self, PyObject *args) {
    unsigned long long data;
    long long n;
    unsigned int crc;
    uint32_t result;
    if (!PyArg_ParseTuple(args, "KLI", &data, &n, &crc)) return NULL;
    Py_BEGIN_ALLOW_THREADS result = crc32_bytes(crc, ADDRESS(data), n);
    Py_END_ALLOW_THREADS return PyLong_FromUnsignedLong(result);
}

static PyMethodDef methods[] = {
    {"square_sums_f32", py_square_sums_f32, METH_VARARGS, "(x, n, chunk0, chunk1, out): chunk sums of squares"},
    {"square_sums_int4", py_square_sums_int4, METH_VARARGS,
     "(scales, codes, n, block, chunk0, chunk1, out): chunk sums of squares of decoded int4 values"},
    {"accumulate_f32", py_accumulate_f32, METH_VARARGS, "(acc, x, i0, i1, alpha, first): acc (+)= x * alpha"},
    {"accumulate_int4", py_accumulate_int4, METH_VARARGS,
     "(acc, scales, codes, block, i0, i1, alpha, first): acc (+)= decoded * alpha"},
    {"nesterov_int8", py_nesterov_int8, METH_VARARGS,
     "(g, m, p, r, scales, codes, n, block, lr, mu, first, check, b0, b1, maxima): outer step and int8 change"},
    {"scale_f32", py_scale_f32, METH_VARARGS, "(x, i0, i1, factor, divide): x *= factor, or x /= factor"},
    {"crc32", py_crc32, METH_VARARGS, "(data, n, crc): zlib.crc32 of n bytes at data, continuing crc"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "ddiloco's compiled syncer kernels", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    crc_init();
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    if (PyModule_AddIntConstant(mod, "NORM_CHUNK", NORM_CHUNK) || PyModule_AddIntConstant(mod, "LANES", LANES)) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
