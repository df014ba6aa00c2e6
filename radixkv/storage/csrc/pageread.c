/* radixkv.storage._native: the file tier's page reads, compiled (no Python, no GIL per page).
 *
 * Optional: setup.py builds it when a C compiler is present; radixkv.storage.native falls back
 * to FileStorage._read_one (the reference) when it is absent or RADIXKV_PURE_PYTHON is set.
 * tests/storage/test_file_storage_native.py runs both on the same damaged files and compares.
 *
 * read_pages(paths, keys, parts, version) -> bytes
 *
 *   paths: list of str (each page's file), keys: list of bytes (each page's key),
 *   parts: list (one per page) of lists of writable C-contiguous byte buffers (the payload's
 *          destinations, in order), version: the format version a file must carry.
 *
 * Returns one code per page: 0 hit, 1 absent, 2 corrupt, 3 error (FileStorage._read_one's
 * verdicts). Per page, with the GIL released: open, one preadv scattering the payload into its
 * buffers then key, trailer and one byte more, close, the trailer's fields, and xxh3-64 of
 * payload, key and trailer from its version on (format v2, radixkv/storage/file.py). A corrupt
 * page's buffers may hold bytes: the caller zeroes them (and unlinks the file). O(bytes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include "xxhash.h"
#ifdef XXHASH_X86_DISPATCH
#include "xxh_x86dispatch.h" /* xxh3 with the widest vector unit the CPU has (AVX2, AVX-512), as python-xxhash */
#endif

#define MAX_KEY 1024
#define TRAILER 40
#define SUMMED 16
#define MAX_PARTS 16

typedef struct {
    const char *path;
    const char *key;
    Py_ssize_t klen;
    int nparts;
    Py_buffer bufs[MAX_PARTS];
} page_t;

static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static char read_one(const page_t *pg, unsigned version) {
    unsigned char tail[MAX_KEY + TRAILER + 1];
    struct iovec iov[MAX_PARTS + 1];
    size_t size = 0;
    size_t tlen = (size_t)pg->klen + TRAILER + 1;
    int fd;
    ssize_t got;
    for (int j = 0; j < pg->nparts; j++) {
        iov[j].iov_base = pg->bufs[j].buf;
        iov[j].iov_len = (size_t)pg->bufs[j].len;
        size += (size_t)pg->bufs[j].len;
    }
    iov[pg->nparts].iov_base = tail;
    iov[pg->nparts].iov_len = tlen;
    do {
        fd = open(pg->path, O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return errno == ENOENT ? 1 : 3;
    do {
        got = preadv(fd, iov, pg->nparts + 1, 0);
    } while (got < 0 && errno == EINTR);
    close(fd);
    if (got < 0) return 3;
    if ((size_t)got != size + tlen - 1) return 2;
    const unsigned char *t = tail + pg->klen;
    if (memcmp(t, "RKVPAGE\0", 8) != 0 || le(t + 16, 2) != version || le(t + 20, 4) != (uint64_t)pg->klen
        || le(t + 24, 8) != (uint64_t)size || memcmp(tail, pg->key, (size_t)pg->klen) != 0)
        return 2;
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    for (int j = 0; j < pg->nparts; j++) XXH3_64bits_update(&st, iov[j].iov_base, iov[j].iov_len);
    XXH3_64bits_update(&st, tail, (size_t)pg->klen);
    XXH3_64bits_update(&st, t + SUMMED, TRAILER - SUMMED);
    return XXH3_64bits_digest(&st) == le(t + 8, 8) ? 0 : 2;
}

static void release(page_t *pages, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        for (int j = 0; j < pages[i].nparts; j++) PyBuffer_Release(&pages[i].bufs[j]);
    PyMem_Free(pages);
}

static PyObject *read_pages(PyObject *self, PyObject *args) {
    PyObject *paths, *keys, *parts;
    unsigned int version;
    if (!PyArg_ParseTuple(args, "O!O!O!I", &PyList_Type, &paths, &PyList_Type, &keys, &PyList_Type, &parts,
                          &version))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(paths);
    if (PyList_GET_SIZE(keys) != n || PyList_GET_SIZE(parts) != n) {
        PyErr_SetString(PyExc_ValueError, "paths, keys and parts must have one entry per page");
        return NULL;
    }
    page_t *pages = PyMem_Calloc(n ? (size_t)n : 1, sizeof(page_t));
    if (pages == NULL) return PyErr_NoMemory();
    Py_ssize_t done = 0;
    for (; done < n; done++) {  /* every argument checked before any file is opened */
        page_t *pg = &pages[done];
        PyObject *key = PyList_GET_ITEM(keys, done), *bufs = PyList_GET_ITEM(parts, done);
        pg->path = PyUnicode_Check(PyList_GET_ITEM(paths, done)) ? PyUnicode_AsUTF8(PyList_GET_ITEM(paths, done)) : NULL;
        if (pg->path == NULL || !PyBytes_Check(key) || PyBytes_GET_SIZE(key) > MAX_KEY || !PyList_Check(bufs)
            || PyList_GET_SIZE(bufs) > MAX_PARTS) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "each page needs a str path, a bytes key of <= 1024 bytes and "
                                                  "a list of at most 16 buffers");
            release(pages, done + 1);
            return NULL;
        }
        pg->key = PyBytes_AS_STRING(key);
        pg->klen = PyBytes_GET_SIZE(key);
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(bufs); j++) {
            if (PyObject_GetBuffer(PyList_GET_ITEM(bufs, j), &pg->bufs[j], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
                release(pages, done + 1);
                return NULL;
            }
            pg->nparts = (int)j + 1;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) {
        release(pages, n);
        return NULL;
    }
    char *codes = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) codes[i] = read_one(&pages[i], version);
    Py_END_ALLOW_THREADS
    release(pages, n);
    return out;
}

static PyMethodDef methods[] = {
    {"read_pages", read_pages, METH_VARARGS, "Read and check page files into buffers; one code per page."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "radixkv.storage._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
