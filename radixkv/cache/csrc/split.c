/* radixkv.cache._native, split.c: the end of a match inside a node (RadixCache._split_end
 * with its InsertMixin._split), for match() when the cache uses the stock ones.
 * (part of one translation unit: module.c includes it; see module.c)
 *
 * Why: a match ending inside a node (a prompt that stops inside a cached turn, a shared
 * system prompt) ran both methods in Python, a few thousand instructions per such match
 * and about 8% of the compiled match's instructions in the benchmark (count_radix.py).
 * Taken only when the cache's class has the stock _split_end / _split / _new_id, no
 * on_split hook and the node keeps no KV-event hashes; else the Python method runs. */

static PyObject *py_split_end = NULL, *py_split = NULL, *py_new_id = NULL;
static PyObject *s_on_split = NULL, *s_split_name = NULL, *s_new_id_name = NULL, *s_split_end_name = NULL;

PyDoc_STRVAR(bind_split_doc, "bind_split(RadixCache._split_end, InsertMixin._split, RadixCache._new_id): "
                             "the methods match() may run in C when a cache's class has these very ones.");

static PyObject *bind_split(PyObject *self, PyObject *args) {
    PyObject *se, *sp, *ni;
    if (!PyArg_ParseTuple(args, "OOO", &se, &sp, &ni))
        return NULL;
    if ((s_on_split == NULL && (s_on_split = PyUnicode_InternFromString("_on_split")) == NULL) ||
        (s_split_name == NULL && (s_split_name = PyUnicode_InternFromString("_split")) == NULL) ||
        (s_new_id_name == NULL && (s_new_id_name = PyUnicode_InternFromString("_new_id")) == NULL) ||
        (s_split_end_name == NULL && (s_split_end_name = PyUnicode_InternFromString("_split_end")) == NULL))
        return NULL;
    Py_INCREF(se); Py_XSETREF(py_split_end, se);
    Py_INCREF(sp); Py_XSETREF(py_split, sp);
    Py_INCREF(ni); Py_XSETREF(py_new_id, ni);
    Py_RETURN_NONE;
}

/* 1 when the C split may stand in for cache._split_end(child, ...): the stock methods, no
 * on_split hook, no hashes on child; 0 when not; -1 with an error set. */
static int split_in_c(PyObject *self, PyObject *d, PyTypeObject *t, PyObject *child) {
    if (py_split_end == NULL || d == NULL || SLOT(child, off_hashes) != Py_None ||
        _PyType_Lookup(t, s_split_end_name) != py_split_end || _PyType_Lookup(t, s_split_name) != py_split ||
        _PyType_Lookup(t, s_new_id_name) != py_new_id)
        return 0;
    PyObject *hook = aget(self, d, s_on_split);
    if (hook == NULL)
        return -1;
    int ok = hook == Py_None;
    Py_DECREF(hook);
    return ok;
}

/* An int slot's value. 0, or -1 with an error set. */
static int int_slot(PyObject *o, Py_ssize_t off, long long *v) {
    PyObject *x = SLOT(o, off);
    if (x == NULL || !PyLong_CheckExact(x)) {
        PyErr_SetString(PyExc_TypeError, "split: a node's counter is not an int");
        return -1;
    }
    *v = PyLong_AsLongLong(x);
    return *v == -1 && PyErr_Occurred() ? -1 : 0;
}

/* cache._split_end(child, buf, pos, n, tick, vals) in C: split off child's pages that match
 * buf[pos:n] into a new parent (InsertMixin._split), touch it, and widen the path's rows
 * (the list vals, plus the new node's). Returns (pos, node, tick, rows) like the method. */
static PyObject *split_end_c(PyObject *self, PyObject *d, PyObject *child, PyObject *buf, Py_ssize_t pos,
                             Py_ssize_t n, Py_ssize_t pb, long long tick, PyObject *vals) {
    PyObject *kb = SLOT(child, off_kbuf), *vb = SLOT(child, off_vbuf), *parent = SLOT(child, off_parent);
    if (kb == NULL || vb == NULL || parent == NULL || !PyBytes_CheckExact(kb) || !PyBytes_CheckExact(vb) ||
        !PyList_CheckExact(vals) || PyObject_TypeCheck(parent, node_type) == 0 ||
        PyBytes_GET_SIZE(vb) != PyBytes_GET_SIZE(kb)) {
        PyErr_SetString(PyExc_TypeError, "split: unexpected node fields");
        return NULL;
    }
    /* common_prefix_tokens(kb, buf, pos, n), floored to whole pages */
    Py_ssize_t kl = PyBytes_GET_SIZE(kb), lim = (kl < n - pos ? kl : n - pos) >> 2, m = 0;
    const int32_t *a = (const int32_t *)PyBytes_AS_STRING(kb), *b = (const int32_t *)(PyBytes_AS_STRING(buf) + pos);
    while (m < lim && a[m] == b[m])
        m++;
    m = m * 4 - (m * 4) % pb;  /* bytes */
    if (m <= 0 || m >= kl) {
        PyErr_SetString(PyExc_RuntimeError, "split: the walk's split point is not inside the node");
        return NULL;
    }
    long long created, prio, last, hits;
    PyObject *lock = SLOT(child, off_lock);
    if (int_slot(child, off_created, &created) < 0 || int_slot(child, off_prio, &prio) < 0 ||
        int_slot(child, off_last, &last) < 0 || int_slot(child, off_hits, &hits) < 0 || lock == NULL)
        return NULL;
    PyObject *idobj = NULL, *nk = NULL, *nv = NULL, *ck = NULL, *cv = NULL, *tk = NULL, *pr = NULL, *node = NULL,
        *page = NULL, *first = NULL, *res = NULL;
    /* everything read from child's old kbuf / vbuf is copied out before they are replaced
     * (replacing them may free them) */
    if ((nk = PyBytes_FromStringAndSize(PyBytes_AS_STRING(kb), m)) == NULL ||
        (first = page_key(PyBytes_AS_STRING(kb), pb)) == NULL ||
        (nv = PyBytes_FromStringAndSize(PyBytes_AS_STRING(vb), m)) == NULL ||
        (ck = PyBytes_FromStringAndSize(PyBytes_AS_STRING(kb) + m, kl - m)) == NULL ||
        (cv = PyBytes_FromStringAndSize(PyBytes_AS_STRING(vb) + m, kl - m)) == NULL ||
        (page = page_key(PyBytes_AS_STRING(kb) + m, pb)) == NULL ||
        (tk = PyLong_FromLongLong(created)) == NULL || (pr = PyLong_FromLongLong(prio)) == NULL ||
        PyList_Append(vals, nv) < 0)
        goto done;
    /* ---- mutation: nothing below fails on the tree's state (only on memory) ---- */
    if ((idobj = aincr(self, d, s_next_id, 1)) == NULL)  /* self._new_id() */
        goto done;
    PyObject *nn[6] = {idobj, parent, nk, nv, tk, pr};
    if ((node = new_node(NULL, nn, 6)) == NULL)
        goto done;
    if (set_int_slot(node, off_last, last) < 0 || set_int_slot(node, off_hits, hits) < 0)
        goto done;
    Py_SETREF(SLOT(node, off_lock), Py_NewRef(lock));
    Py_SETREF(SLOT(child, off_kbuf), Py_NewRef(ck));
    Py_SETREF(SLOT(child, off_vbuf), Py_NewRef(cv));
    Py_SETREF(SLOT(child, off_parent), Py_NewRef(node));
    if (PyDict_SetItem(SLOT(node, off_children), page, child) < 0)
        goto done;
    Py_SETREF(SLOT(node, off_only), Py_NewRef(child));
    PyObject *pch = SLOT(parent, off_children);
    if (pch == NULL || !PyDict_CheckExact(pch) || PyDict_SetItem(pch, first, node) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "split: a node's children is not a dict");
        goto done;
    }
    if (SLOT(parent, off_only) == child)
        Py_SETREF(SLOT(parent, off_only), Py_NewRef(node));
    /* touch the new node (the match ends there): last_access = ++tick; hits += 1 */
    if (set_int_slot(node, off_last, ++tick) < 0 || set_int_slot(node, off_hits, hits + 1) < 0)
        goto done;
    PyObject *rows = widen(&PyList_GET_ITEM(vals, 0), PyList_GET_SIZE(vals), (pos + m) >> 2), *po = NULL, *to = NULL;
    if (rows == NULL || (po = PyLong_FromSsize_t(pos + m)) == NULL || (to = PyLong_FromLongLong(tick)) == NULL ||
        (res = PyTuple_New(4)) == NULL) {
        Py_XDECREF(rows);
        Py_XDECREF(po);
        Py_XDECREF(to);
        goto done;
    }
    PyTuple_SET_ITEM(res, 0, po);
    PyTuple_SET_ITEM(res, 1, Py_NewRef(node));
    PyTuple_SET_ITEM(res, 2, to);
    PyTuple_SET_ITEM(res, 3, rows);
done:
    Py_XDECREF(idobj); Py_XDECREF(nk); Py_XDECREF(nv); Py_XDECREF(ck); Py_XDECREF(cv); Py_XDECREF(tk);
    Py_XDECREF(pr); Py_XDECREF(node); Py_XDECREF(page); Py_XDECREF(first);
    return res;
}
