/* radixkv.cache._native, match.c: RadixCache.match_prefix, whole, for its common case.
 * (part of one translation unit: module.c includes it; see module.c) */

/* ---------------------------------------------------------------- match_prefix, whole */

static PyObject *py_match = NULL;          /* the Python RadixCache.match_prefix (the reference) */
static PyTypeObject *key_type = NULL, *result_type = NULL;
static PyObject *s_buf, *s_extra_key, *s_cwalk, *s_on_device, *s_pb, *s_heads, *s_disable, *s_clock,
    *s_qlog, *s_qfold, *s_metrics, *s_compact, *s_split_end;

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
    INTERN(s_buf, "_buf"); INTERN(s_extra_key, "extra_key"); INTERN(s_cwalk, "_cwalk");
    INTERN(s_on_device, "_on_device"); INTERN(s_pb, "_pb"); INTERN(s_heads, "_heads");
    INTERN(s_disable, "disable"); INTERN(s_clock, "_clock"); INTERN(s_qlog, "_qlog");
    INTERN(s_qfold, "_qfold"); INTERN(s_metrics, "_metrics"); INTERN(s_compact, "compact");
    INTERN(s_split_end, "_split_end");
#undef INTERN
    Py_INCREF(f); Py_XSETREF(py_match, f);
    Py_INCREF(kt); Py_XSETREF(key_type, (PyTypeObject *)kt);
    Py_INCREF(rt); Py_XSETREF(result_type, (PyTypeObject *)rt);
    Py_RETURN_NONE;
}

/* getattr(o, name) is v (new reference in *out); -1 with an error set. */
static int get(PyObject *o, PyObject *name, PyObject **out) {
    *out = PyObject_GetAttr(o, name);
    return *out == NULL ? -1 : 0;
}

PyDoc_STRVAR(match_doc,
"match_prefix(key, extra_key=None) -> MatchResult\n\n"
"The longest cached page-aligned prefix of key and its KV rows: see\n"
"RadixCache.match_prefix (Python), the contract and the reference. This compiled entry takes the\n"
"common case whole (a RadixKey, a cache whose compiled walk is on, a CPU result, a key with a\n"
"whole page in an existing namespace) and hands every other call to it unchanged.");

static PyObject *match(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *self, *key, *buf = NULL, *ek = NULL, *cw = NULL, *dev = NULL, *pbo = NULL, *heads = NULL,
        *head = NULL, *dis = NULL, *clock = NULL, *w = NULL, *res = NULL, *log = NULL;
    if (py_match == NULL || node_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "radixkv.cache._native: bind()/bind_match() not called");
        return NULL;
    }
    if (kwnames != NULL || nargs != 2 || Py_TYPE(args[1]) != key_type)
        return PyObject_Vectorcall(py_match, args, nargs, kwnames);
    self = args[0];
    key = args[1];
    if (get(self, s_cwalk, &cw) < 0)
        return NULL;
    int take = cw != Py_None;
    Py_DECREF(cw);
    if (take) {
        if (get(self, s_on_device, &dev) < 0)
            return NULL;
        take = dev == Py_False;
        Py_DECREF(dev);
    }
    if (!take)
        return PyObject_Vectorcall(py_match, args, nargs, NULL);
    if (get(key, s_buf, &buf) < 0 || get(key, s_extra_key, &ek) < 0 || get(self, s_pb, &pbo) < 0 ||
        get(self, s_heads, &heads) < 0 || get(self, s_disable, &dis) < 0)
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
    if (get(self, s_clock, &clock) < 0)
        goto done;
    long long tick = PyLong_AsLongLong(clock);
    if (tick == -1 && PyErr_Occurred())
        goto done;
    if (!PyObject_TypeCheck(head, node_type)) {
        PyErr_SetString(PyExc_TypeError, "match: a namespace head is not a TreeNode");
        goto done;
    }
    w = walk_at(head, buf, n, pb, tick);
    if (w == NULL)
        goto done;
    if (PyTuple_GET_ITEM(w, 4) != Py_None) {  /* ended inside a node: cache._split_end splits it */
        PyObject *nobj = PyLong_FromSsize_t(n), *r = NULL;
        if (nobj != NULL)
            r = PyObject_CallMethodObjArgs(self, s_split_end, PyTuple_GET_ITEM(w, 4), buf, PyTuple_GET_ITEM(w, 0),
                                           nobj, PyTuple_GET_ITEM(w, 2), PyTuple_GET_ITEM(w, 3), NULL);
        Py_XDECREF(nobj);
        if (r == NULL)
            goto done;
        if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 4) {
            Py_DECREF(r);
            PyErr_SetString(PyExc_TypeError, "match: _split_end must return (pos, node, tick, rows)");
            goto done;
        }
        Py_SETREF(w, r);  /* (pos, node, tick, rows): the layout of walk's first four */
    }
    Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(w, 0));
    if (pos == -1 && PyErr_Occurred())
        goto done;
    if (PyObject_SetAttr(self, s_clock, PyTuple_GET_ITEM(w, 2)) < 0 || get(self, s_qlog, &log) < 0)
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
        PyObject *fold = PyObject_GetAttr(self, s_qfold);
        if (fold == NULL)
            goto done;
        Py_ssize_t f = PyLong_AsSsize_t(fold);
        Py_DECREF(fold);
        if (f == -1 && PyErr_Occurred())
            goto done;
        if (PyList_GET_SIZE(log) >= f) {
            PyObject *m = PyObject_GetAttr(self, s_metrics), *r = NULL;
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
    PyTuple_SET_ITEM(res, 0, Py_NewRef(PyTuple_GET_ITEM(w, 3)));
    PyTuple_SET_ITEM(res, 1, Py_NewRef(PyTuple_GET_ITEM(w, 1)));
    PyTuple_SET_ITEM(res, 2, plen);
done:
    Py_XDECREF(buf); Py_XDECREF(ek); Py_XDECREF(pbo); Py_XDECREF(heads); Py_XDECREF(head); Py_XDECREF(dis);
    Py_XDECREF(clock); Py_XDECREF(w); Py_XDECREF(log);
    return res;
}

