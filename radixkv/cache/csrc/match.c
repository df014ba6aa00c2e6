/* radixkv.cache._native, match.c: RadixCache.match_prefix, whole, for its common case.
 * (part of one translation unit: module.c includes it; see module.c) */

/* ---------------------------------------------------------------- match_prefix, whole */

static PyObject *py_match = NULL;          /* the Python RadixCache.match_prefix (the reference) */
static PyTypeObject *key_type = NULL, *result_type = NULL;
static PyObject *s_buf, *s_extra_key, *s_compact, *s_split_end;
static Py_ssize_t off_kbufk, off_kek;  /* RadixKey's slots _buf and extra_key */  /* (the cache's own names: attrs.c) */

PyDoc_STRVAR(bind_match_doc, "bind_match(py_match, RadixKey, MatchResult): the Python match_prefix "
                             "that match() hands every case it does not take itself.");

static PyObject *bind_match(PyObject *self, PyObject *args) {
    PyObject *f, *kt, *rt;
    if (!PyArg_ParseTuple(args, "OO!O!", &f, &PyType_Type, &kt, &PyType_Type, &rt))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)rt, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "bind_match: MatchResult must be a tuple subclass");
        return NULL;
    }
#define INTERN(v, s) if ((v = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(s_buf, "_buf"); INTERN(s_extra_key, "extra_key"); INTERN(s_compact, "compact");
    INTERN(s_split_end, "_split_end");
#undef INTERN
    if (intern_cache_names() < 0 || slot_offset((PyTypeObject *)kt, "_buf", &off_kbufk) < 0 ||
        slot_offset((PyTypeObject *)kt, "extra_key", &off_kek) < 0)
        return NULL;
    Py_INCREF(f); Py_XSETREF(py_match, f);
    Py_INCREF(kt); Py_XSETREF(key_type, (PyTypeObject *)kt);
    Py_INCREF(rt); Py_XSETREF(result_type, (PyTypeObject *)rt);
    Py_RETURN_NONE;
}

/* getattr(o, name) (new reference in *out; through d = cache_dict(o), see attrs.c); -1 with
 * an error set. */
static int get(PyObject *o, PyObject *d, PyObject *name, PyObject **out) {
    *out = aget(o, d, name);
    return *out == NULL ? -1 : 0;
}

/* key._buf and key.extra_key (RadixKey slots, new references in *buf / *ek); -1 with an
 * error set. */
static int key_parts(PyObject *key, PyObject **buf, PyObject **ek) {
    *buf = SLOT(key, off_kbufk);
    *ek = SLOT(key, off_kek);
    if (*buf == NULL || *ek == NULL) {
        *buf = *ek = NULL;
        PyErr_SetString(PyExc_AttributeError, "RadixKey: _buf / extra_key not set");
        return -1;
    }
    Py_INCREF(*buf);
    Py_INCREF(*ek);
    return 0;
}

PyDoc_STRVAR(match_doc,
"match_prefix(key, extra_key=None) -> MatchResult\n\n"
"The longest cached page-aligned prefix of key and its KV rows: see\n"
"RadixCache.match_prefix (Python), the contract and the reference. This compiled entry takes the\n"
"common case whole (a RadixKey, a cache whose compiled walk is on, a CPU result, a key with a\n"
"whole page in an existing namespace) and hands every other call to it unchanged.");

static PyObject *match(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *self, *key, *d = NULL, *buf = NULL, *ek = NULL, *cw = NULL, *dev = NULL, *pbo = NULL, *heads = NULL,
        *head = NULL, *dis = NULL, *clock = NULL, *res = NULL, *log = NULL, *node = NULL, *tk = NULL, *rows = NULL;
    touch_ctx tc;
    touch_init(&tc, 0);
    if (py_match == NULL || node_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "radixkv.cache._native: bind()/bind_match() not called");
        return NULL;
    }
    if (kwnames != NULL || nargs != 2 || Py_TYPE(args[1]) != key_type)
        return PyObject_Vectorcall(py_match, args, nargs, kwnames);
    self = args[0];
    key = args[1];
    d = cache_dict(self);
    if (get(self, d, s_native_walk, &cw) < 0)
        goto done;
    int take = cw != Py_None;
    Py_DECREF(cw);
    if (take) {
        if (get(self, d, s_on_device, &dev) < 0)
            goto done;
        take = dev == Py_False;
        Py_DECREF(dev);
    }
    if (!take) {
        res = PyObject_Vectorcall(py_match, args, nargs, NULL);
        goto done;
    }
    if (key_parts(key, &buf, &ek) < 0 || get(self, d, s_page_bytes, &pbo) < 0 || get(self, d, s_heads, &heads) < 0 ||
        get(self, d, s_disable, &dis) < 0)
        goto done;
    if (!PyBytes_CheckExact(buf) || !PyDict_CheckExact(heads)) {
        PyErr_SetString(PyExc_TypeError, "match: unexpected RadixKey._buf or cache._heads");
        goto done;
    }
    Py_ssize_t pb, nbytes = PyBytes_GET_SIZE(buf);
    if (page_bytes(pbo, &pb) < 0)
        goto done;
    Py_ssize_t n = nbytes - nbytes % pb;
    head = PyDict_GetItemWithError(heads, ek);
    if (head == NULL && PyErr_Occurred())
        goto done;
    Py_XINCREF(head);  /* owned: the walk's result building may run Python code (a GC pass) */
    int disabled = PyObject_IsTrue(dis);
    if (disabled < 0)
        goto done;
    if (n == 0 || head == NULL || disabled) {
        res = PyObject_Vectorcall(py_match, args, nargs, NULL);
        goto done;
    }
    if (get(self, d, s_clock, &clock) < 0)
        goto done;
    long long tick = PyLong_AsLongLong(clock);
    if (tick == -1 && PyErr_Occurred())
        goto done;
    tc.tick = tick;
    if (!PyObject_TypeCheck(head, node_type)) {
        PyErr_SetString(PyExc_TypeError, "match: a namespace head is not a TreeNode");
        goto done;
    }
    /* the walk (touching each matched node), its results kept in C: no tuple in between */
    Py_ssize_t pos;
    PyObject *wnode, *wsplit;
    if (descend(head, PyBytes_AS_STRING(buf), n, pb, touch, &tc, &pos, &wnode, &wsplit) < 0)
        goto done;
    node = Py_NewRef(wnode);  /* owned from here: what follows may run Python code (a GC pass) */
    if (wsplit == Py_None) {
        if ((rows = widen(tc.vals.items, tc.vals.n, pos >> 2)) == NULL || (tk = PyLong_FromLongLong(tc.tick)) == NULL)
            goto done;
    } else {  /* ended inside a node: cache._split_end splits it */
        PyObject *split = Py_NewRef(wsplit), *vals = node_vec_list(&tc.vals), *r = NULL;
        int inc = vals == NULL ? -1 : split_in_c(self, d, Py_TYPE(self), split);
        if (inc > 0) {  /* the same, in C (split.c) */
            r = split_end_c(self, d, split, buf, pos, n, pb, tc.tick, vals);
        } else if (inc == 0) {
            PyObject *po = PyLong_FromSsize_t(pos), *nobj = PyLong_FromSsize_t(n), *to = PyLong_FromLongLong(tc.tick);
            if (po != NULL && nobj != NULL && to != NULL)
                r = PyObject_CallMethodObjArgs(self, s_split_end, split, buf, po, nobj, to, vals, NULL);
            Py_XDECREF(po); Py_XDECREF(nobj); Py_XDECREF(to);
        }
        Py_DECREF(split);
        Py_XDECREF(vals);
        if (r == NULL)
            goto done;
        if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 4) {
            Py_DECREF(r);
            PyErr_SetString(PyExc_TypeError, "match: _split_end must return (pos, node, tick, rows)");
            goto done;
        }
        pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(r, 0));
        Py_SETREF(node, Py_NewRef(PyTuple_GET_ITEM(r, 1)));
        tk = Py_NewRef(PyTuple_GET_ITEM(r, 2));
        rows = Py_NewRef(PyTuple_GET_ITEM(r, 3));
        Py_DECREF(r);
        if (pos == -1 && PyErr_Occurred())
            goto done;
    }
    if (aset(self, d, s_clock, tk) < 0 || get(self, d, s_query_log, &log) < 0)
        goto done;
    if (log != Py_None) {
        PyObject *qa = PyLong_FromSsize_t(nbytes >> 2), *qb = PyLong_FromSsize_t(pos >> 2), *q = NULL;
        if (qa != NULL && qb != NULL)
            q = PyTuple_Pack(2, qa, qb);
        Py_XDECREF(qa);
        Py_XDECREF(qb);
        if (q == NULL || PyList_Append(log, q) < 0) {
            Py_XDECREF(q);
            goto done;
        }
        Py_DECREF(q);
        PyObject *fold = aget(self, d, s_query_log_limit);
        if (fold == NULL)
            goto done;
        Py_ssize_t f = PyLong_AsSsize_t(fold);
        Py_DECREF(fold);
        if (f == -1 && PyErr_Occurred())
            goto done;
        if (PyList_GET_SIZE(log) >= f) {
            PyObject *m = aget(self, d, s_metrics), *r = NULL;
            if (m != NULL) {
                r = PyObject_CallMethodNoArgs(m, s_compact);
                Py_DECREF(m);
            }
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        }
    }
    PyObject *plen = PyLong_FromSsize_t(pos >> 2);
    if (plen == NULL)
        goto done;
    res = result_type->tp_alloc(result_type, 3);
    if (res == NULL) {
        Py_DECREF(plen);
        goto done;
    }
    PyTuple_SET_ITEM(res, 0, Py_NewRef(rows));
    PyTuple_SET_ITEM(res, 1, Py_NewRef(node));
    PyTuple_SET_ITEM(res, 2, plen);
done:
    Py_XDECREF(buf); Py_XDECREF(ek); Py_XDECREF(pbo); Py_XDECREF(heads); Py_XDECREF(head); Py_XDECREF(dis);
    Py_XDECREF(clock); Py_XDECREF(log); Py_XDECREF(d); Py_XDECREF(node); Py_XDECREF(tk); Py_XDECREF(rows);
    node_vec_clear(&tc.vals);
    return res;
}

