/* radixkv.cache._native: what every part shares (one translation unit, see module.c). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

static PyTypeObject *node_type = NULL;
static Py_ssize_t off_kbuf, off_only, off_children, off_vbuf, off_last, off_hits;
static Py_ssize_t off_skey, off_lock, off_parent, off_prio, off_created, off_id, off_hashes, off_pstate;
static PyObject *from_dlpack = NULL;  /* torch._C._from_dlpack: a match's rows tensor (rows.c) */

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* The two bulk loops get an AVX2 clone next to the baseline one (x86-64's baseline has no
 * packed int32 <-> int64 conversion); the loader picks one per CPU (GNU ifunc). */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define BULK_LOOP __attribute__((target_clones("avx2", "default")))
#else
#define BULK_LOOP
#endif

/* Both loops unrolled 4x: a match widens ~3,400 rows on the benchmark, and the rolled AVX2
 * loop spent ~1.1 instructions a row on its loop control (count_radix.py). */
#if defined(__GNUC__) && !defined(__clang__)
#define UNROLL4 _Pragma("GCC unroll 4")
#elif defined(__clang__)
#define UNROLL4 _Pragma("clang loop unroll_count(4)")
#else
#define UNROLL4
#endif

/* out[i] = src[i] for i < m (int32 -> int64). */
BULK_LOOP static void widen_rows(int64_t *restrict out, const int32_t *restrict src, Py_ssize_t m) {
    UNROLL4
    for (Py_ssize_t i = 0; i < m; i++)
        out[i] = src[i];
}

/* dst[i] = (int32)src[i] for i < m; returns the OR of every src[i] (as unsigned), whose
 * bits >= 31 are all clear exactly when every src[i] lies in [0, 2**31). */
BULK_LOOP static uint64_t narrow_rows(int32_t *restrict dst, const int64_t *restrict src, Py_ssize_t m) {
    uint64_t acc = 0;
    UNROLL4
    for (Py_ssize_t i = 0; i < m; i++) {
        acc |= (uint64_t)src[i];
        dst[i] = (int32_t)src[i];
    }
    return acc;
}
