/* radixkv.allocator._native: the KV allocators' checked free, compiled (one pass, no sort).
 *
 * Optional: setup.py builds it when a C compiler is present; radixkv.allocator.native falls
 * back to the numpy path of the allocators (the contract and the reference) when it is absent
 * or RADIXKV_PURE_PYTHON is set. tests/allocator/test_allocator_native.py runs both on the same frees,
 * good and bad, and compares every result, error and state.
 *
 * mark_free(ids, mask, ring, pos, shift, num_ids, ascending) -> int
 *
 *   ids:  1-D C-contiguous int64 slot ids (a buffer), in the caller's order.
 *   mask: the free list's ``not_in_use`` bool mask (writable, num_ids + 1 bytes).
 *   ring: the int32 ring buffer the pages go to (writable); ``pos``: where the tail is.
 *   shift: log2(page size) (0: slots are pages).
 *
 * Takes the free only when it is valid and in the common layout: every page (slot >> shift)
 * in 1..num_ids and not in use, each page's slots one strictly ascending run, no page in two
 * runs. Then it marks the pages not in use, writes them into the ring from ``pos`` (wrapping;
 * in the caller's order, ascending when ``ascending``) and returns how many it wrote. The
 * caller advances the ring's tail and checked its room first. Anything else (a bad id, a
 * double free, a repeat, a page split over runs, a buffer of another type) returns -1 with
 * nothing changed: the caller's exact path then frees it or names the bad ids.
 *
 * The double-free and repeat check is the mask itself: a page is marked as it is reached, so a
 * page met twice finds its mark (the marks are undone on failure). O(k), plus O(p log p) to
 * sort p pages when ``ascending``.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int get_buf(PyObject *o, Py_buffer *b, Py_ssize_t itemsize, const char *formats, int writable) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        return -1;
    }
    if (b->itemsize != itemsize || b->ndim != 1 || b->format == NULL || b->format[0] == '\0' ||
        b->format[1] != '\0' || strchr(formats, b->format[0]) == NULL) {
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Validate and mark; the pages go to out[0..n). Returns n, or -1 with every mark undone. */
static Py_ssize_t mark(const int64_t *ids, Py_ssize_t k, uint8_t *mask, int shift, int64_t num_ids,
                       int32_t *out) {
    Py_ssize_t n = 0;
    if (shift == 0) { /* slots are pages: the same checks, one branch-light step per id */
        for (; n < k; n++) {
            int64_t page = ids[n];
            if ((uint64_t)(page - 1) >= (uint64_t)num_ids || mask[page]) goto undo;
            mask[page] = 1;
            out[n] = (int32_t)page;
        }
        return n;
    }
    int64_t prev_page = -1, prev_slot = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t slot = ids[i], page = slot >> shift;
        if (page == prev_page && i > 0) {
            if (slot <= prev_slot) goto undo; /* a repeat, or a run that is not ascending */
        } else {
            if (page < 1 || page > num_ids || mask[page]) goto undo; /* range, double free, repeat */
            mask[page] = 1;
            out[n++] = (int32_t)page;
            prev_page = page;
        }
        prev_slot = slot;
    }
    return n;
undo:
    for (Py_ssize_t j = 0; j < n; j++) mask[out[j]] = 0;
    return -1;
}

PyDoc_STRVAR(mark_free_doc,
             "mark_free(ids, mask, ring, pos, shift, num_ids, ascending) -> pages written, or -1 "
             "(nothing changed). See the module's source for the contract.");

static PyObject *mark_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "mark_free takes 7 arguments");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[3]);
    long shift = PyLong_AsLong(args[4]);
    long long num_ids = PyLong_AsLongLong(args[5]);
    int ascending = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer ib, mb, rb;
    Py_ssize_t n = -1;
    if (get_buf(args[0], &ib, 8, "lq", 0) < 0) return PyLong_FromLong(-1);
    if (get_buf(args[1], &mb, 1, "?B", 1) < 0) {
        PyBuffer_Release(&ib);
        return PyLong_FromLong(-1);
    }
    if (get_buf(args[2], &rb, 4, "i", 1) < 0) {
        PyBuffer_Release(&mb);
        PyBuffer_Release(&ib);
        return PyLong_FromLong(-1);
    }
    Py_ssize_t k = ib.shape[0], cap = rb.shape[0];
    int32_t *pages = k ? (int32_t *)PyMem_Malloc((size_t)k * sizeof(int32_t)) : NULL;
    if (k && pages == NULL) {
        PyErr_NoMemory();
    } else if (k > 0 && k <= cap && pos >= 0 && pos < cap && shift >= 0 && shift < 63 && num_ids >= 0 &&
               num_ids < mb.shape[0] && num_ids <= INT32_MAX) {
        n = mark((const int64_t *)ib.buf, k, (uint8_t *)mb.buf, (int)shift, num_ids, pages);
        if (n > 0) {
            if (ascending) {
                int sorted = 1;
                for (Py_ssize_t j = 1; j < n && sorted; j++) sorted = pages[j - 1] < pages[j];
                if (!sorted) qsort(pages, (size_t)n, sizeof(int32_t), cmp_i32);
            }
            int32_t *ring = (int32_t *)rb.buf;
            Py_ssize_t first = n < cap - pos ? n : cap - pos;
            memcpy(ring + pos, pages, (size_t)first * sizeof(int32_t));
            if (n > first) memcpy(ring, pages + first, (size_t)(n - first) * sizeof(int32_t));
        }
    }
    PyMem_Free(pages);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&mb);
    PyBuffer_Release(&ib);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"mark_free", (PyCFunction)(void (*)(void))mark_free, METH_FASTCALL, mark_free_doc},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "radixkv.allocator._native",
                                    "The KV allocators' checked free, compiled (see radixkv.allocator.native).",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
