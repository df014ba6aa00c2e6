/* radixkv.memory._native: the host tier's page copies on the CPU, compiled (one pass, no GIL).
 *
 * Optional: setup.py builds it when a C compiler is present; radixkv.memory.native falls back
 * to HostKVPool's torch path (the reference) when it is absent or RADIXKV_PURE_PYTHON is set.
 * tests/memory/test_host_kv_pool.py runs both on the same copies and compares every byte.
 *
 * copy_pages(host_addr, host_pages, page_bytes, chunk, host_ids, dev_addrs, dev_pages, dev_ids,
 *            to_device) -> None
 *
 *   host_addr: address of the host buffer, host_pages rows of page_bytes (page-first: chunk c
 *              of a row is layer c // 2, K (c even) or V (c odd)).
 *   dev_addrs: a tuple of len(chunks) addresses (k0, v0, k1, v1, ...), each dev_pages pages of
 *              chunk bytes (an MHATokenToKVPool's buffers, rows page-aligned).
 *   host_ids, dev_ids: 1-D C-contiguous int64 buffers of equal length n.
 *   to_device: 1 copies host page host_ids[i] into device page dev_ids[i]; 0 the reverse.
 *
 * Every id is checked before any byte moves (ValueError, nothing copied). Then, with the GIL
 * released, one copy per page and chunk (streaming stores where aligned, see copy_chunk): the
 * bytes are read once and written once. The
 * caller keeps the buffers alive and unshared for the call (the Python side checks their
 * types, shapes and devices). O(n x chunks) memcpy calls, O(bytes) traffic.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_CHUNKS 1024
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* A chunk copy. With SSE2 and 16-byte aligned chunks of at least 4 KiB: non-temporal stores
 * (the destination is not read first; a plain memcpy of this size would pull each destination
 * line into the cache before writing it, a third memory transfer). */
static void copy_chunk(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    if (n >= 4096 && n % 64 == 0 && ((uintptr_t)dst % 16) == 0 && ((uintptr_t)src % 16) == 0) {
        __m128i *d = (__m128i *)dst;
        const __m128i *s = (const __m128i *)src;
        for (size_t i = 0; i < n / 16; i += 4) {
            __m128i a = _mm_load_si128(s + i), b = _mm_load_si128(s + i + 1);
            __m128i c = _mm_load_si128(s + i + 2), e = _mm_load_si128(s + i + 3);
            _mm_stream_si128(d + i, a);
            _mm_stream_si128(d + i + 1, b);
            _mm_stream_si128(d + i + 2, c);
            _mm_stream_si128(d + i + 3, e);
        }
        return;
    }
#endif
    memcpy(dst, src, n);
}

static int get_ids(PyObject *o, Py_buffer *b) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (b->itemsize != 8 || b->ndim != 1 || b->format == NULL || strchr("qlL", b->format[0]) == NULL
            || b->format[1] != '\0') {
        PyBuffer_Release(b);
        PyErr_SetString(PyExc_TypeError, "ids must be a 1-D C-contiguous int64 buffer");
        return -1;
    }
    return 0;
}

static int in_range(const int64_t *ids, Py_ssize_t n, long long limit, const char *what) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= limit) {
            PyErr_Format(PyExc_ValueError, "%s page %lld out of [0, %lld)", what, (long long)ids[i], limit);
            return -1;
        }
    }
    return 0;
}

static PyObject *copy_pages(PyObject *self, PyObject *args) {
    unsigned long long host_addr;
    long long host_pages, page_bytes, chunk, dev_pages;
    PyObject *host_o, *dev_addrs_o, *dev_o;
    int to_device;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLLLOOLOp", &host_addr, &host_pages, &page_bytes, &chunk, &host_o,
                          &dev_addrs_o, &dev_pages, &dev_o, &to_device))
        return NULL;
    if (!PyTuple_Check(dev_addrs_o)) {
        PyErr_SetString(PyExc_TypeError, "dev_addrs must be a tuple of addresses");
        return NULL;
    }
    Py_ssize_t nc = PyTuple_GET_SIZE(dev_addrs_o);
    if (nc < 1 || nc > MAX_CHUNKS || chunk < 1 || (long long)nc * chunk != page_bytes) {
        PyErr_SetString(PyExc_ValueError, "page_bytes must be len(dev_addrs) chunks of chunk bytes");
        return NULL;
    }
    char *dev[MAX_CHUNKS];
    for (Py_ssize_t c = 0; c < nc; c++) {
        dev[c] = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(dev_addrs_o, c));
        if (PyErr_Occurred())
            return NULL;
    }
    Py_buffer hb, db;
    if (get_ids(host_o, &hb) < 0)
        return NULL;
    if (get_ids(dev_o, &db) < 0) {
        PyBuffer_Release(&hb);
        return NULL;
    }
    Py_ssize_t n = hb.len / 8;
    const int64_t *hid = (const int64_t *)hb.buf, *did = (const int64_t *)db.buf;
    PyObject *ret = NULL;
    if (db.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "host_ids and dev_ids differ in length");
    } else if (in_range(hid, n, host_pages, "host") == 0 && in_range(did, n, dev_pages, "device") == 0) {
        char *host = (char *)(uintptr_t)host_addr;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            char *row = host + hid[i] * page_bytes;
            long long off = did[i] * chunk;
            for (Py_ssize_t c = 0; c < nc; c++) {
                if (to_device)
                    copy_chunk(dev[c] + off, row + c * chunk, (size_t)chunk);
                else
                    copy_chunk(row + c * chunk, dev[c] + off, (size_t)chunk);
            }
        }
#if defined(__SSE2__)
        _mm_sfence();  /* the streamed stores are visible before the call returns */
#endif
        Py_END_ALLOW_THREADS
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyBuffer_Release(&hb);
    PyBuffer_Release(&db);
    return ret;
}

static PyMethodDef methods[] = {
    {"copy_pages", copy_pages, METH_VARARGS, "Copy whole pages between the host tier and a CPU KV pool."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
