/* radixkv.cache._native, insert.c: RadixCache.insert, whole, for its common case.
 * (part of one translation unit: module.c includes it; see module.c) */

/* ---------------------------------------------------------------- insert, whole */

static PyObject *py_insert = NULL;  /* InsertMixin.insert, radix_insert.py (the reference) */
static PyObject *t_int64 = NULL, *t_tensor = NULL;
static PyObject *s_dtype, *s_ndim, *s_is_cpu, *s_is_contiguous, *s_is_neg, *s_data_ptr, *s_inserts,
    *s_inserted_tokens, *s_numel;  /* (the cache's own names: attrs.c) */

PyDoc_STRVAR(bind_insert_doc, "bind_insert(py_insert, torch.Tensor, torch.int64): the Python insert "
                              "that insert() hands every case it does not take itself.");

static PyObject *bind_insert(PyObject *self, PyObject *args) {
    PyObject *f, *tt, *i64;
    if (!PyArg_ParseTuple(args, "OO!O", &f, &PyType_Type, &tt, &i64))
        return NULL;
#define INTERN(v, s) if ((v = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(s_dtype, "dtype"); INTERN(s_ndim, "ndim"); INTERN(s_is_cpu, "is_cpu");
    INTERN(s_is_contiguous, "is_contiguous"); INTERN(s_is_neg, "is_neg"); INTERN(s_data_ptr, "data_ptr");
    INTERN(s_inserts, "inserts"); INTERN(s_inserted_tokens, "inserted_tokens"); INTERN(s_numel, "numel");
#undef INTERN
    if (intern_cache_names() < 0)
        return NULL;
    Py_INCREF(f); Py_XSETREF(py_insert, f);
    Py_INCREF(tt); Py_XSETREF(t_tensor, tt);
    Py_INCREF(i64); Py_XSETREF(t_int64, i64);
    Py_RETURN_NONE;
}

/* Consumes v (a new reference, or NULL after an error): 1 when v is want, 0 when it is not,
 * -1 for NULL (the error stays set). */
static int is(PyObject *v, PyObject *want) {
    if (v == NULL)
        return -1;
    int r = v == want;
    Py_DECREF(v);
    return r;
}
#define attr_is(o, name, want) is(PyObject_GetAttr((o), (name)), (want))
#define cache_is(name, want) is(aget(self, d, (name)), (want))
#define call_is_true(o, name) is(PyObject_CallMethodNoArgs((o), (name)), Py_True)

PyDoc_STRVAR(insert_doc,
"insert(key, value, priority=0, extra_key=None, _path=False) -> int | (int, node, path)\n\n"
"Insert key (whole pages) with its KV rows; returns the tokens already cached (with _path:\n"
"also the node where the key ends and the matched path): see\n"
"radixkv.cache.radix_insert.InsertMixin.insert, the contract and the reference. This compiled entry\n"
"takes the common case whole (a RadixKey, a contiguous 1-D CPU int64 tensor, an int\n"
"priority, extra_key None, an existing namespace, no split, no KV events, a policy without\n"
"hooks) and hands every other call to it unchanged, before changing anything.");

static PyObject *insert(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *self, *key, *value, *prio, *res = NULL;
    PyObject *d = NULL, *buf = NULL, *ek = NULL, *pbo = NULL, *heads = NULL, *head = NULL, *node = NULL, *tail = NULL,
        *leaf = NULL, *clock = NULL, *v = NULL;
    long long p = 0;
    int want_path = 0;
    node_vec path;
    node_vec_init(&path);
    if (py_insert == NULL || node_type == NULL || key_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "radixkv.cache._native: bind()/bind_match()/bind_insert() not called");
        return NULL;
    }
    /* (self, key, value[, priority[, extra_key None[, _path True/False]]]), positional only */
    if (kwnames != NULL || nargs < 3 || nargs > 6 || Py_TYPE(args[1]) != key_type ||
        Py_TYPE(args[2]) != (PyTypeObject *)t_tensor || (nargs >= 4 && !PyLong_CheckExact(args[3])) ||
        (nargs >= 5 && args[4] != Py_None) || (nargs == 6 && args[5] != Py_True && args[5] != Py_False))
        return PyObject_Vectorcall(py_insert, args, nargs, kwnames);
    want_path = nargs == 6 && args[5] == Py_True;
    self = args[0];
    key = args[1];
    value = args[2];
    prio = nargs >= 4 ? args[3] : NULL;
    if (prio != NULL) {
        int overflow;
        p = PyLong_AsLongLongAndOverflow(prio, &overflow);
        if (overflow || (p == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            goto python;
        }
    }
    /* the cache: compiled walks on (set only for lazily ordered policies without on_hit), no
     * KV events, no on_insert hook, not disabled; the value: a 1-D CPU int64 tensor */
    int r;
    d = cache_dict(self);
    if ((r = cache_is(s_native_walk, Py_None)) != 0 || (r = cache_is(s_kv_events, Py_None)) != 1 ||
        (r = cache_is(s_on_insert, Py_None)) != 1 || (r = cache_is(s_disable, Py_False)) != 1 ||
        (r = attr_is(value, s_dtype, t_int64)) != 1 || (r = attr_is(value, s_is_cpu, Py_True)) != 1) {
        if (r < 0)
            goto done;
        goto python;
    }
    if ((v = PyObject_GetAttr(value, s_ndim)) == NULL)
        goto done;
    r = PyLong_CheckExact(v) && PyLong_AsLong(v) == 1;
    Py_CLEAR(v);
    if (!r)
        goto python;
    if (key_parts(key, &buf, &ek) < 0 || (pbo = aget(self, d, s_page_bytes)) == NULL ||
        (heads = aget(self, d, s_heads)) == NULL)
        goto done;
    if (!PyBytes_CheckExact(buf) || !PyDict_CheckExact(heads))
        goto python;
    Py_ssize_t pb, n = PyBytes_GET_SIZE(buf);
    if (page_bytes(pbo, &pb) < 0)
        goto done;
    /* value.numel() (1-D: its length); len(tensor) runs Tensor.__len__ in Python (~1.2 us) */
    if ((v = PyObject_CallMethodNoArgs(value, s_numel)) == NULL)
        goto done;
    Py_ssize_t rows = PyLong_AsSsize_t(v);
    Py_CLEAR(v);
    if (rows == -1 && PyErr_Occurred())
        goto done;
    if (n == 0 || n % pb || rows != n >> 2)
        goto python;  /* Python raises AlignmentError / LengthMismatchError, or returns 0 */
    head = PyDict_GetItemWithError(heads, ek);
    if (head == NULL) {
        if (PyErr_Occurred())
            goto done;
        goto python;  /* a new namespace */
    }
    Py_INCREF(head);
    if (!PyObject_TypeCheck(head, node_type)) {
        PyErr_SetString(PyExc_TypeError, "insert: a namespace head is not a TreeNode");
        goto done;
    }
    /* the read-only walk (find's descent), the matched nodes kept in a C array (owned) */
    Py_ssize_t pos;
    PyObject *split;
    if (descend(head, PyBytes_AS_STRING(buf), n, pb, collect, &path, &pos, &node, &split) < 0) {
        node = NULL;
        goto done;
    }
    Py_INCREF(node);  /* owned: the checks below call into torch */
    if (split != Py_None)
        goto python;  /* the cached prefix ends inside a node: a split */
    if (pos < n) {  /* the new rows: contiguous, no neg bit, all in [0, 2**31) */
        int ok = call_is_true(value, s_is_contiguous), neg = ok == 1 ? call_is_true(value, s_is_neg) : 0;
        if (ok < 0 || neg < 0)
            goto done;
        if (!ok || neg)
            goto python;
        if ((v = PyObject_CallMethodNoArgs(value, s_data_ptr)) == NULL)
            goto done;
        PyObject *nargs3[3];
        nargs3[0] = v;
        nargs3[1] = PyLong_FromSsize_t(n >> 2);
        nargs3[2] = PyLong_FromSsize_t(pos >> 2);
        if (nargs3[1] != NULL && nargs3[2] != NULL)
            tail = narrow(NULL, nargs3, 3);
        Py_XDECREF(nargs3[1]);
        Py_XDECREF(nargs3[2]);
        Py_CLEAR(v);
        if (tail == NULL)
            goto done;
        if (tail == Py_None)
            goto python;  /* a row out of range: Python raises */
    }
    /* ---- mutation (nothing below goes back to Python's insert) ---- */
    if ((clock = aget(self, d, s_clock)) == NULL)
        goto done;
    long long tick = PyLong_AsLongLong(clock);
    if (tick == -1 && PyErr_Occurred())
        goto done;
    for (Py_ssize_t i = 0; i < path.n; i++) {
        PyObject *x = path.items[i], *xp = SLOT(x, off_prio);
        if (set_int_slot(x, off_last, ++tick) < 0)
            goto done;
        long long xv = PyLong_AsLongLong(xp);
        if (xv == -1 && PyErr_Occurred())
            goto done;
        if (xv < p && set_int_slot(x, off_prio, p) < 0)
            goto done;
    }
    if (pos < n) {
        PyObject *ptail = NULL, *page = NULL, *idobj = NULL, *tk = NULL, *pr = NULL, *leaves = NULL;
        int bad = (idobj = aincr(self, d, s_next_id, 1)) == NULL ||
                  (ptail = PyBytes_FromStringAndSize(PyBytes_AS_STRING(buf) + pos, n - pos)) == NULL ||
                  (tk = PyLong_FromLongLong(++tick)) == NULL || (pr = PyLong_FromLongLong(p)) == NULL;
        if (!bad) {
            PyObject *nn[6] = {idobj, node, ptail, tail, tk, pr};
            bad = (leaf = new_node(NULL, nn, 6)) == NULL;
        }
        Py_XDECREF(ptail); Py_XDECREF(idobj); Py_XDECREF(tk); Py_XDECREF(pr);
        if (bad || (leaves = aget(self, d, s_leaves)) == NULL)
            goto done;
        if (SLOT(node, off_skey) != Py_None) {  /* the parent stops being a leaf */
            if (leaves_remove(leaves, node) < 0) {
                Py_DECREF(leaves);
                goto done;
            }
            Py_SETREF(SLOT(node, off_skey), Py_NewRef(Py_None));
        }
        PyObject *ch = SLOT(node, off_children);
        bad = (page = page_key(PyBytes_AS_STRING(buf) + pos, pb)) == NULL ||
              PyDict_SetItem(ch, page, leaf) < 0;
        Py_XDECREF(page);
        if (!bad) {
            Py_SETREF(SLOT(node, off_only), Py_NewRef(PyDict_GET_SIZE(ch) == 1 ? leaf : Py_None));
            bad = aadd(self, d, s_evictable, (n - pos) >> 2) < 0;
        }
        if (!bad) {  /* leaf.skey = cache._sort_key(leaf); leaves.add(leaf) */
            PyObject *sk = aget(self, d, s_sort_key), *kv = NULL;
            if (sk != NULL)
                kv = PyObject_CallOneArg(sk, leaf);
            Py_XDECREF(sk);
            if (kv == NULL)
                bad = 1;
            else
                Py_SETREF(SLOT(leaf, off_skey), kv);
        }
        if (!bad && leaves_add(leaves, leaf) < 0)
            bad = 1;
        Py_DECREF(leaves);
        if (bad)
            goto done;
    }
    PyObject *tko = PyLong_FromLongLong(tick), *m = NULL;
    if (tko == NULL || aset(self, d, s_clock, tko) < 0) {
        Py_XDECREF(tko);
        goto done;
    }
    Py_DECREF(tko);
    if ((m = aget(self, d, s_metrics)) == NULL)
        goto done;
    if (slot_add(m, metrics_type, off_minserts, s_inserts, 1) < 0 ||
        slot_add(m, metrics_type, off_mtokens, s_inserted_tokens, (n - pos) >> 2) < 0) {
        Py_DECREF(m);
        goto done;
    }
    Py_DECREF(m);
    res = PyLong_FromSsize_t(pos >> 2);
    if (res != NULL && want_path) {  /* (prefix, the node where the key ends, the matched path) */
        PyObject *pl = node_vec_list(&path);
        if (pl == NULL)
            Py_CLEAR(res);
        else
            Py_SETREF(res, PyTuple_Pack(3, res, leaf != NULL ? leaf : node, pl));
        Py_XDECREF(pl);
    }
    goto done;
python:
    res = PyObject_Vectorcall(py_insert, args, nargs, NULL);
done:
    Py_XDECREF(buf); Py_XDECREF(ek); Py_XDECREF(pbo); Py_XDECREF(heads); Py_XDECREF(head);
    Py_XDECREF(node); node_vec_clear(&path); Py_XDECREF(tail); Py_XDECREF(leaf); Py_XDECREF(clock); Py_XDECREF(v); Py_XDECREF(d);
    return res;
}

