/* radixkv.cache._native, attrs.c: the cache's own attributes and its leaf index, read and
 * written without the generic attribute protocol.
 * (part of one translation unit: module.c includes it; see module.c)
 *
 * Why: match_prefix and insert read ~10-15 attributes of the cache per call; each
 * PyObject_GetAttr is a type lookup (MRO walk through the type cache), a descriptor check
 * and then the instance-dict probe, and the counters written back (clock, sizes) cost the
 * same again in PyObject_SetAttr. Callgrind put that protocol at about a third of an
 * insert's instructions (benchmarks/count_radix.py). Here:
 *
 * - cache_dict(self): the instance __dict__, when no name below is an attribute of the
 *   cache's class (checked once per class and re-checked when the class changes: its
 *   version tag). getattr/setattr of those names is then exactly the dict's item, so
 *   aget/aset probe the dict directly (one hash probe on an interned string).
 * - leaves_add/leaves_remove: LeafIndex.add/remove (radixkv.cache.leaf_index) on its slots,
 *   without their Python frames (the same steps in the same order; any other index class,
 *   or a state they do not expect, goes to its Python methods).
 */

static PyObject *s_native_walk, *s_on_device, *s_page_bytes, *s_heads, *s_disable, *s_clock, *s_query_log,
    *s_query_log_limit, *s_metrics, *s_kv_events, *s_on_insert, *s_next_id, *s_leaves, *s_evictable, *s_sort_key;
static PyObject **const cache_names[] = {&s_native_walk, &s_on_device, &s_page_bytes, &s_heads, &s_disable,
                                         &s_clock, &s_query_log, &s_query_log_limit, &s_metrics, &s_kv_events,
                                         &s_on_insert, &s_next_id, &s_leaves, &s_evictable, &s_sort_key};
#define N_CACHE_NAMES ((int)(sizeof(cache_names) / sizeof(cache_names[0])))

/* Intern the names above (once). 0, or -1 with an error set. */
static int intern_cache_names(void) {
    static const char *const text[N_CACHE_NAMES] = {"_native_walk", "_on_device", "_page_bytes", "_heads",
                                                    "disable", "_clock", "_query_log", "_query_log_limit",
                                                    "_metrics", "kv_events", "_on_insert", "_next_id", "_leaves",
                                                    "_evictable", "_sort_key"};
    for (int i = 0; i < N_CACHE_NAMES; i++)
        if (*cache_names[i] == NULL && (*cache_names[i] = PyUnicode_InternFromString(text[i])) == NULL)
            return -1;
    return 0;
}

/* Classes checked to define none of the names (strong references), with the version tag
 * they had then: a class changed since (tag differs) is checked again. */
#define PLAIN_TYPES 4
static PyTypeObject *plain_type[PLAIN_TYPES];
static unsigned int plain_tag[PLAIN_TYPES];
static int plain_next;

static int version_valid(PyTypeObject *t) {
#ifdef Py_TPFLAGS_VALID_VERSION_TAG
    return (t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) && t->tp_version_tag != 0;
#else
    (void)t;
    return 0;
#endif
}

/* 1 when t uses the generic attribute protocol and no cache name is an attribute of t or of
 * a base (a class attribute, a property, a slot): the instance dict then decides getattr and
 * setattr of those names alone. */
static int plain_type_check(PyTypeObject *t) {
    for (int i = 0; i < PLAIN_TYPES; i++)
        if (plain_type[i] == t && plain_tag[i] == t->tp_version_tag && version_valid(t))
            return 1;
    if (s_native_walk == NULL || t->tp_getattro != PyObject_GenericGetAttr || t->tp_setattro != PyObject_GenericSetAttr)
        return 0;  /* (a __getattribute__ / __getattr__ / __setattr__ of its own: the generic protocol) */
    for (int i = 0; i < N_CACHE_NAMES; i++)
        if (_PyType_Lookup(t, *cache_names[i]) != NULL)
            return 0;
    if (version_valid(t)) {  /* (_PyType_Lookup assigned the tag) */
        int k = plain_next;
        plain_next = (plain_next + 1) % PLAIN_TYPES;
        Py_INCREF(t);
        Py_XSETREF(plain_type[k], t);
        plain_tag[k] = t->tp_version_tag;
    }
    return 1;
}

/* The cache's instance dict (new reference) when aget/aset may use it, else NULL (no error
 * set): the generic protocol then. */
static PyObject *cache_dict(PyObject *self) {
    if (!plain_type_check(Py_TYPE(self)))
        return NULL;
    PyObject *d = PyObject_GenericGetDict(self, NULL);
    if (d == NULL || !PyDict_CheckExact(d)) {
        PyErr_Clear();
        Py_XDECREF(d);
        return NULL;
    }
    return d;
}

/* getattr(o, name) (new reference), through d = cache_dict(o) when it is not NULL. */
static PyObject *aget(PyObject *o, PyObject *d, PyObject *name) {
    if (d != NULL) {
        PyObject *v = PyDict_GetItemWithError(d, name);
        if (v != NULL)
            return Py_NewRef(v);
        if (PyErr_Occurred())
            return NULL;
    }
    return PyObject_GetAttr(o, name);  /* not set: the generic protocol raises AttributeError */
}

/* setattr(o, name, v), through d = cache_dict(o) when it is not NULL. 0, or -1 with an error. */
static int aset(PyObject *o, PyObject *d, PyObject *name, PyObject *v) {
    return d != NULL ? PyDict_SetItem(d, name, v) : PyObject_SetAttr(o, name, v);
}

/* o.name += delta for an int attribute; the new value (a new reference), or NULL with an
 * error set. */
static PyObject *aincr(PyObject *o, PyObject *d, PyObject *name, Py_ssize_t delta) {
    PyObject *v = aget(o, d, name), *r = NULL;
    if (v == NULL)
        return NULL;
    if (PyLong_CheckExact(v)) {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (!overflow && !(x == -1 && PyErr_Occurred()) && x < ((long long)1 << 62) && x > -((long long)1 << 62))
            r = PyLong_FromLongLong(x + delta);
        PyErr_Clear();
    }
    if (r == NULL) {
        PyObject *dd = PyLong_FromSsize_t(delta);
        if (dd != NULL)
            r = PyNumber_Add(v, dd);
        Py_XDECREF(dd);
    }
    Py_DECREF(v);
    if (r != NULL && aset(o, d, name, r) < 0)
        Py_CLEAR(r);
    return r;
}

/* o.name += delta. 0, or -1 with an error set. */
static int aadd(PyObject *o, PyObject *d, PyObject *name, Py_ssize_t delta) {
    PyObject *r = aincr(o, d, name, delta);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* o's object slot at off (an int) += delta; for slotted counters (CacheMetrics), else
 * setattr. 0, or -1 with an error set. */
static int slot_add(PyObject *o, PyTypeObject *t, Py_ssize_t off, PyObject *name, Py_ssize_t delta) {
    if (t != NULL && Py_TYPE(o) == t) {
        PyObject *v = SLOT(o, off);
        if (v != NULL && PyLong_CheckExact(v)) {
            int overflow;
            long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (!overflow && !(x == -1 && PyErr_Occurred()) && x < ((long long)1 << 62)) {
                PyObject *r = PyLong_FromLongLong(x + delta);
                if (r == NULL)
                    return -1;
                SLOT(o, off) = r;
                Py_DECREF(v);
                return 0;
            }
            PyErr_Clear();
        }
    }
    return aadd(o, NULL, name, delta);
}

/* ---------------------------------------------------------------- the metrics' counters */

static PyTypeObject *metrics_type = NULL;  /* radixkv.cache.metrics.CacheMetrics */
static Py_ssize_t off_minserts, off_mtokens;

PyDoc_STRVAR(bind_metrics_doc, "bind_metrics(CacheMetrics): the metrics class whose insert counters "
                               "(slots) the compiled insert adds to itself.");

static PyObject *bind_metrics(PyObject *self, PyObject *mt) {
    if (!PyType_Check(mt)) {
        PyErr_SetString(PyExc_TypeError, "bind_metrics(CacheMetrics)");
        return NULL;
    }
    if (slot_offset((PyTypeObject *)mt, "inserts", &off_minserts) < 0 ||
        slot_offset((PyTypeObject *)mt, "inserted_tokens", &off_mtokens) < 0)
        return NULL;
    Py_INCREF(mt);
    Py_XSETREF(metrics_type, (PyTypeObject *)mt);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- the leaf index */

static PyTypeObject *leaf_type = NULL;  /* radixkv.cache.leaf_index.LeafIndex */
static Py_ssize_t off_lheap, off_llive, off_lseq, leaf_slack;
static PyObject *heappush_fn = NULL, *s_add = NULL, *s_remove = NULL, *s_compact_leaves = NULL;

PyDoc_STRVAR(bind_leaves_doc, "bind_leaves(LeafIndex, heapq.heappush, slack): the leaf index class whose "
                              "add/remove the compiled insert runs itself, and its compaction slack.");

static PyObject *bind_leaves(PyObject *self, PyObject *args) {
    PyObject *lt, *hp;
    Py_ssize_t slack;
    if (!PyArg_ParseTuple(args, "O!On", &PyType_Type, &lt, &hp, &slack))
        return NULL;
    Py_ssize_t offs[3];
    static const char *names[3] = {"_heap", "_live", "_seq"};
    for (int i = 0; i < 3; i++)
        if (slot_offset((PyTypeObject *)lt, names[i], &offs[i]) < 0)
            return NULL;
    if ((s_add == NULL && (s_add = PyUnicode_InternFromString("add")) == NULL) ||
        (s_remove == NULL && (s_remove = PyUnicode_InternFromString("remove")) == NULL) ||
        (s_compact_leaves == NULL && (s_compact_leaves = PyUnicode_InternFromString("_compact")) == NULL))
        return NULL;
    off_lheap = offs[0]; off_llive = offs[1]; off_lseq = offs[2];
    leaf_slack = slack;
    Py_INCREF(hp); Py_XSETREF(heappush_fn, hp);
    Py_INCREF(lt); Py_XSETREF(leaf_type, (PyTypeObject *)lt);
    Py_RETURN_NONE;
}

/* The index's heap list, live dict and filing counter (borrowed) when leaves is a LeafIndex
 * in the state its methods leave it; 0 otherwise (the caller runs the Python method). */
static int leaf_parts(PyObject *leaves, PyObject **heap, PyObject **live, PyObject **seq) {
    if (leaf_type == NULL || Py_TYPE(leaves) != leaf_type)
        return 0;
    *heap = SLOT(leaves, off_lheap);
    *live = SLOT(leaves, off_llive);
    *seq = SLOT(leaves, off_lseq);
    return *heap != NULL && PyList_CheckExact(*heap) && *live != NULL && PyDict_CheckExact(*live) && *seq != NULL &&
           PyIter_Check(*seq);
}

/* leaves.add(node): file node under node.skey. 0, or -1 with an error set. */
static int leaves_add(PyObject *leaves, PyObject *node) {
    PyObject *heap, *live, *seqit;
    if (leaf_parts(leaves, &heap, &live, &seqit)) {
        PyObject *seq = PyIter_Next(seqit);
        if (seq == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "leaf index: its filing counter ended");
            return -1;
        }
        PyObject *got = PyDict_SetDefault(live, node, seq);  /* borrowed */
        if (got == seq) {
            PyObject *skey = SLOT(node, off_skey), *entry, *r = NULL;
            if (skey == NULL)
                skey = Py_None;
            entry = PyTuple_Pack(3, skey, seq, node);
            Py_DECREF(seq);
            if (entry == NULL)
                return -1;
            PyObject *a[2] = {heap, entry};
            r = PyObject_Vectorcall(heappush_fn, a, 2, NULL);
            Py_DECREF(entry);
            Py_XDECREF(r);
            return r == NULL ? -1 : 0;
        }
        Py_DECREF(seq);
        if (got == NULL)
            return -1;
        /* filed already: the Python method raises InvariantError (nothing changed) */
    }
    PyObject *r = PyObject_CallMethodOneArg(leaves, s_add, node);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* leaves.remove(node): unfile node (KeyError when it is not filed). 0, or -1 with an error. */
static int leaves_remove(PyObject *leaves, PyObject *node) {
    PyObject *heap, *live, *seqit;
    if (leaf_parts(leaves, &heap, &live, &seqit)) {
        if (PyDict_DelItem(live, node) < 0)
            return -1;
        if (PyList_GET_SIZE(heap) > 2 * PyDict_GET_SIZE(live) + leaf_slack) {
            PyObject *r = PyObject_CallMethodNoArgs(leaves, s_compact_leaves);
            Py_XDECREF(r);
            return r == NULL ? -1 : 0;
        }
        return 0;
    }
    PyObject *r = PyObject_CallMethodOneArg(leaves, s_remove, node);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}
