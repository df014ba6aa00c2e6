/* radixkv.cache._native, rows.c: row buffers: the pooled int64 results (widen) and the int32 narrowing.
 * (part of one translation unit: module.c includes it; see module.c) */

/* A match's rows reach torch as a DLPack capsule (torch._C._from_dlpack): the tensor is made
 * straight over our buffer, no numpy array, view or slice in between (torch.from_numpy of a
 * sliced numpy view cost ~3,600 instructions a match, a quarter of it; this ~1,000). The
 * buffer is freed (or its pool slot released) by the capsule's deleter, which torch calls once,
 * when the tensor's storage dies: the last tensor, view or .numpy() array over it. That may
 * happen on any thread, with or without the GIL, so the deleter calls no Python API (free(),
 * an atomic store).
 *
 * The legacy (unversioned) DLPack ABI, "dltensor" capsules: the structs below are its
 * definition (dlpack.h, stable since DLPack 0.2). */
typedef struct { int32_t device_type, device_id; } DLDevice;  /* kDLCPU = 1 */
typedef struct { uint8_t code, bits; uint16_t lanes; } DLDataType;  /* kDLInt = 0 */
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *);
} DLManagedTensor;

/* One result's header: the managed tensor (first: the deleter casts back), its shape and
 * stride, and the pool slot's flag it releases (NULL: a malloc'd block, header + data). */
typedef struct {
    DLManagedTensor m;
    int64_t shape, stride;
    int *used;
} rows_block;
#define ROWS_HDR ((sizeof(rows_block) + 63) & ~(size_t)63)

/* Result buffers. A match's int64 rows are the largest fresh allocation on the path (up to
 * 1 MiB here), and when malloc serves one from new heap pages every page faults on its first
 * write (2-15 us each on the VM the benchmark runs on). So results of POOL_MIN..POOL_MAX tokens
 * go into pooled buffers, a few per power-of-two size class: a buffer is taken by one result
 * and given back by that result's deleter (above), so a live result is never overwritten.
 * Memory: at most POOL_PER_CLASS buffers per class, 4 x (8 KiB + ... + 1 MiB) < 8 MiB in
 * all, only for the classes used. */
#define POOL_MIN_SHIFT 10 /* 1,024 tokens */
#define POOL_CLASSES 8    /* up to 131,072 tokens */
#define POOL_PER_CLASS 4
typedef struct {
    rows_block hdr;  /* the live result's header (while used) */
    int64_t *data;   /* the buffer (allocated on first use, kept for the process) */
    int used;        /* taken by a live result; set under the GIL, cleared by its deleter */
} pool_slot;
static pool_slot pool[POOL_CLASSES][POOL_PER_CLASS];

static void rows_deleter(DLManagedTensor *m) {
    rows_block *b = (rows_block *)m;
    if (b->used != NULL)
        __atomic_store_n(b->used, 0, __ATOMIC_RELEASE);
    else
        free(b);
}

/* A capsule torch never consumed (it renames the ones it takes) frees its block. */
static void capsule_free(PyObject *cap) {
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *m = (DLManagedTensor *)PyCapsule_GetPointer(cap, "dltensor");
        m->deleter(m);
    }
}

/* A result block of ntok int64 rows, the caller to fill at ->m.dl_tensor.data: a free
 * pooled buffer when one fits, else a malloc'd block. NULL with MemoryError set. */
static rows_block *rows_alloc(Py_ssize_t ntok) {
    rows_block *b = NULL;
    void *data = NULL;
    int *used = NULL;
    if (ntok >= ((Py_ssize_t)1 << POOL_MIN_SHIFT) && ntok <= ((Py_ssize_t)1 << (POOL_MIN_SHIFT + POOL_CLASSES - 1))) {
        int c = 0;
        while (((Py_ssize_t)1 << (POOL_MIN_SHIFT + c)) < ntok)
            c++;
        for (int i = 0; i < POOL_PER_CLASS && b == NULL; i++) {
            pool_slot *s = &pool[c][i];
            if (__atomic_load_n(&s->used, __ATOMIC_ACQUIRE))
                continue;
            if (s->data == NULL && (s->data = aligned_alloc(64, (size_t)8 << (POOL_MIN_SHIFT + c))) == NULL)
                break;  /* out of memory: a malloc'd block below, or MemoryError */
            __atomic_store_n(&s->used, 1, __ATOMIC_RELAXED);
            b = &s->hdr;
            data = s->data;
            used = &s->used;
        }
    }
    if (b == NULL) {
        if ((size_t)ntok > (SIZE_MAX - ROWS_HDR) / 8 || (b = malloc(ROWS_HDR + (size_t)ntok * 8)) == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        data = (char *)b + ROWS_HDR;
    }
    b->shape = ntok;
    b->stride = 1;
    b->used = used;
    b->m.manager_ctx = NULL;
    b->m.deleter = rows_deleter;
    DLTensor *t = &b->m.dl_tensor;
    t->data = data;
    t->device.device_type = 1;  /* kDLCPU */
    t->device.device_id = 0;
    t->ndim = 1;
    t->dtype.code = 0;  /* kDLInt */
    t->dtype.bits = 64;
    t->dtype.lanes = 1;
    t->shape = &b->shape;
    t->strides = &b->stride;
    t->byte_offset = 0;
    return b;
}

PyDoc_STRVAR(pool_stats_doc, "pool_stats() -> [(class_tokens, buffers, in_use)]: the result-buffer pool.");

static PyObject *pool_stats(PyObject *self, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (int c = 0; out != NULL && c < POOL_CLASSES; c++) {
        int have = 0, used = 0;
        for (int i = 0; i < POOL_PER_CLASS; i++)
            if (pool[c][i].data != NULL) {
                have++;
                used += __atomic_load_n(&pool[c][i].used, __ATOMIC_ACQUIRE) != 0;
            }
        PyObject *t = Py_BuildValue("(nii)", (Py_ssize_t)1 << (POOL_MIN_SHIFT + c), have, used);
        if (t == NULL || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    return out;
}

/* The matched rows as an int64 CPU tensor over a result block (above), filled from the int32
 * vbufs. */
static PyObject *widen(PyObject **vals, Py_ssize_t nv, Py_ssize_t ntok) {
    rows_block *b = rows_alloc(ntok);
    if (b == NULL)
        return NULL;
    int64_t *out = (int64_t *)b->m.dl_tensor.data;
    for (Py_ssize_t i = 0; i < nv; i++) {
        Py_ssize_t m = PyBytes_GET_SIZE(vals[i]) >> 2;
        widen_rows(out, (const int32_t *)PyBytes_AS_STRING(vals[i]), m);
        out += m;
    }
    PyObject *cap = PyCapsule_New(&b->m, "dltensor", capsule_free);
    if (cap == NULL) {
        rows_deleter(&b->m);
        return NULL;
    }
    PyObject *t = PyObject_Vectorcall(from_dlpack, &cap, 1, NULL);
    Py_DECREF(cap);  /* (unconsumed after an error: its destructor frees the block) */
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

