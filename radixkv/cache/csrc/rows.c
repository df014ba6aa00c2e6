/* radixkv.cache._native, rows.c: row buffers: the pooled int64 results (widen) and the int32 narrowing.
 * (part of one translation unit: module.c includes it; see module.c) */

/* Result buffers. A match's int64 rows are the largest fresh allocation on the path (up to
 * 64 KiB here), and when malloc serves one from new heap pages every page faults on its first
 * write (2-15 us each on the VM the benchmark runs on). So results of POOL_MIN..POOL_MAX tokens
 * are views into pooled arrays, a few per power-of-two size class: an array is reused once
 * nothing but the pool references it (the result's view holds it, and the tensor holds the
 * view, so a live result is never overwritten). Memory: at most POOL_PER_CLASS arrays per
 * class, 4 x (8 KiB + ... + 1 MiB) < 8 MiB in all, only for the classes used. */
#define POOL_MIN_SHIFT 10 /* 1,024 tokens */
#define POOL_CLASSES 8    /* up to 131,072 tokens */
#define POOL_PER_CLASS 4
static PyObject *pool[POOL_CLASSES][POOL_PER_CLASS];
static int64_t *pool_data[POOL_CLASSES][POOL_PER_CLASS];  /* their buffers (fixed for their lifetime) */

/* A new int64 numpy array of ntok elements (new reference). */
static PyObject *new_array(Py_ssize_t ntok) {
    PyObject *a[2];
    a[0] = PyLong_FromSsize_t(ntok);
    if (a[0] == NULL)
        return NULL;
    a[1] = i64_dtype;
    PyObject *arr = PyObject_Vectorcall(np_empty, a, 2, NULL);
    Py_DECREF(a[0]);
    return arr;
}

/* An array whose first ntok elements the caller may fill: a free pooled one (borrowed from
 * the pool, *pooled = 1, *data its buffer) or a new one of exactly ntok (new reference,
 * *pooled = 0). */
static PyObject *result_array(Py_ssize_t ntok, int *pooled, int64_t **data) {
    *pooled = 0;
    if (ntok >= ((Py_ssize_t)1 << POOL_MIN_SHIFT) && ntok <= ((Py_ssize_t)1 << (POOL_MIN_SHIFT + POOL_CLASSES - 1))) {
        int c = 0;
        while (((Py_ssize_t)1 << (POOL_MIN_SHIFT + c)) < ntok)
            c++;
        for (int i = 0; i < POOL_PER_CLASS; i++) {
            PyObject *arr = pool[c][i];
            if (arr == NULL) {
                if ((arr = new_array((Py_ssize_t)1 << (POOL_MIN_SHIFT + c))) == NULL)
                    return NULL;
                Py_buffer view;
                if (PyObject_GetBuffer(arr, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
                    Py_DECREF(arr);
                    return NULL;
                }
                int ok = view.len >= ((Py_ssize_t)8 << (POOL_MIN_SHIFT + c));
                void *buf = view.buf;
                PyBuffer_Release(&view);
                if (!ok) {
                    Py_DECREF(arr);
                    PyErr_SetString(PyExc_RuntimeError, "walk: np.empty returned a buffer of the wrong size");
                    return NULL;
                }
                Py_XSETREF(pool[c][i], arr);  /* (XSETREF: np.empty may have run a GC pass) */
                pool_data[c][i] = (int64_t *)buf;
            }
            if (Py_REFCNT(arr) == 1) {
                *pooled = 1;
                *data = pool_data[c][i];
                return arr;
            }
        }
    }
    return new_array(ntok);
}

PyDoc_STRVAR(pool_stats_doc, "pool_stats() -> [(class_tokens, arrays, in_use)]: the result-buffer pool.");

static PyObject *pool_stats(PyObject *self, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (int c = 0; out != NULL && c < POOL_CLASSES; c++) {
        int have = 0, used = 0;
        for (int i = 0; i < POOL_PER_CLASS; i++)
            if (pool[c][i] != NULL) {
                have++;
                used += Py_REFCNT(pool[c][i]) > 1;
            }
        PyObject *t = Py_BuildValue("(nii)", (Py_ssize_t)1 << (POOL_MIN_SHIFT + c), have, used);
        if (t == NULL || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    return out;
}

/* The matched rows as an int64 tensor: torch.from_numpy over a result array (above), filled
 * from the int32 vbufs. */
static PyObject *widen(PyObject **vals, Py_ssize_t nv, Py_ssize_t ntok) {
    int pooled;
    int64_t *out = NULL;
    PyObject *arr = result_array(ntok, &pooled, &out);
    if (arr == NULL)
        return NULL;
    Py_buffer view;
    view.obj = NULL;
    if (pooled) {
        Py_INCREF(arr);
    } else {
        if (PyObject_GetBuffer(arr, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(arr);
            return NULL;
        }
        if (view.len < ntok * 8) {
            PyBuffer_Release(&view);
            Py_DECREF(arr);
            PyErr_SetString(PyExc_RuntimeError, "walk: np.empty returned a buffer of the wrong size");
            return NULL;
        }
        out = (int64_t *)view.buf;
    }
    for (Py_ssize_t i = 0; i < nv; i++) {
        Py_ssize_t m = PyBytes_GET_SIZE(vals[i]) >> 2;
        widen_rows(out, (const int32_t *)PyBytes_AS_STRING(vals[i]), m);
        out += m;
    }
    if (!pooled)
        PyBuffer_Release(&view);
    if (pooled) {  /* the result is a view of the first ntok elements; it holds the array */
        PyObject *v = PySequence_GetSlice(arr, 0, ntok);
        Py_SETREF(arr, v);
        if (arr == NULL)
            return NULL;
    }
    PyObject *t = PyObject_Vectorcall(from_numpy, &arr, 1, NULL);
    Py_DECREF(arr);
    return t;
}

PyDoc_STRVAR(narrow_doc,
"narrow(address, count, start) -> bytes | None\n\n"
"Elements [start, count) of the contiguous int64 array of count elements at address (the\n"
"caller's live CPU tensor: data_ptr(), after checking dtype, contiguity and no neg bit) as\n"
"int32 bytes when each lies in [0, 2**31); None when one does not (the caller's general path\n"
"then raises the right error). No copy of the tensor, no numpy view: .numpy() costs ~0.6 us.");

static PyObject *narrow(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "narrow(address, count, start)");
        return NULL;
    }
    void *addr = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (count < 0 || start < 0 || start > count || (addr == NULL && count > 0)) {
        PyErr_SetString(PyExc_ValueError, "narrow: need 0 <= start <= count and an address");
        return NULL;
    }
    Py_ssize_t m = count - start;
    PyObject *b = PyBytes_FromStringAndSize(NULL, m * 4);
    if (b != NULL && m && narrow_rows((int32_t *)PyBytes_AS_STRING(b), (const int64_t *)addr + start, m) >> 31) {
        Py_DECREF(b);  /* a row outside [0, 2**31) */
        Py_RETURN_NONE;
    }
    return b;
}

