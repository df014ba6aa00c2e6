/* radixkv.cache._native, walk.c: the descent shared by match_prefix's walk and insert's find.
 * (part of one translation unit: module.c includes it; see module.c) */

/* *pb = int(o), the bytes of a page: a positive multiple of 4 (cache._page_bytes = 4 x page_size).
 * 0, or -1 with an error set. */
static int page_bytes(PyObject *o, Py_ssize_t *pb) {
    *pb = PyLong_AsSsize_t(o);
    if (*pb == -1 && PyErr_Occurred())
        return -1;
    if (*pb < 4 || *pb % 4) {
        PyErr_SetString(PyExc_ValueError, "the bytes of a page must be 4 x page_size");
        return -1;
    }
    return 0;
}

/* Shared argument checks of walk/find: head, buf, n, pb. */
static int walk_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Py_ssize_t *n, Py_ssize_t *pb) {
    if (node_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "radixkv.cache._native: bind() was not called");
        return -1;
    }
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    if (!PyObject_TypeCheck(args[0], node_type) || !PyBytes_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "walk: head must be a TreeNode and buf bytes");
        return -1;
    }
    *n = PyLong_AsSsize_t(args[2]);
    if ((*n == -1 && PyErr_Occurred()) || page_bytes(args[3], pb) < 0)
        return -1;
    if (*n < 0 || *n > PyBytes_GET_SIZE(args[1]) || *n % *pb) {
        PyErr_SetString(PyExc_ValueError, "walk: need 0 <= n <= len(buf), n a multiple of pb");
        return -1;
    }
    return 0;
}

/* The child of node whose key starts with buf[pos:pos+pb] (borrowed), or NULL: none
 * (no error set) or an error (set). */
static PyObject *child_at(PyObject *node, const char *buf, Py_ssize_t pos, Py_ssize_t pb) {
    PyObject *child = SLOT(node, off_only);
    if (child == NULL || child == Py_None) {
        PyObject *ch = SLOT(node, off_children);
        if (ch == NULL || !PyDict_CheckExact(ch)) {
            PyErr_SetString(PyExc_TypeError, "walk: a node's children is not a dict");
            return NULL;
        }
        if (PyDict_GET_SIZE(ch) == 0)
            return NULL;
        PyObject *k = page_key(buf + pos, pb);
        if (k == NULL)
            return NULL;
        child = PyDict_GetItemWithError(ch, k);
        Py_DECREF(k);
        if (child == NULL)
            return NULL;
    }
    if (Py_TYPE(child) != node_type || SLOT(child, off_kbuf) == NULL || !PyBytes_CheckExact(SLOT(child, off_kbuf))) {
        PyErr_SetString(PyExc_TypeError, "walk: a child is not a TreeNode with bytes kbuf");
        return NULL;
    }
    return child;
}

/* 1: child's whole key matches buf[pos:n]; 0: it does not (*split set when its first page
 * matches, so the caller splits it). */
static int key_matches(PyObject *child, const char *buf, Py_ssize_t pos, Py_ssize_t n, Py_ssize_t pb,
                       PyObject **split) {
    PyObject *kb = SLOT(child, off_kbuf);
    Py_ssize_t kl = PyBytes_GET_SIZE(kb);
    const char *kd = PyBytes_AS_STRING(kb);
    if (kl <= n - pos && memcmp(buf + pos, kd, (size_t)kl) == 0)
        return 1;
    if (kl >= pb && memcmp(buf + pos, kd, (size_t)pb) == 0)
        *split = child;
    return 0;
}

/* Start loading what the walk reads next while it compares child's key (the loads of a
 * descent are chains of dependent misses: node -> its slots' objects -> their bytes): the
 * child's vbuf (its size and first rows), the counters touch() replaces, and the next node
 * (child.only, the lone child most nodes have). Hints only: nothing is dereferenced here
 * but child's own slots, already loaded. */
static inline void prefetch_next(PyObject *child) {
#if defined(__GNUC__)
    PyObject *vb = SLOT(child, off_vbuf), *nx = SLOT(child, off_only);
    __builtin_prefetch(vb, 0, 3);
    __builtin_prefetch((char *)vb + 64, 0, 3);
    __builtin_prefetch(SLOT(child, off_last), 1, 3);
    __builtin_prefetch(SLOT(child, off_hits), 1, 3);
    if (nx != Py_None) {
        __builtin_prefetch((char *)nx - 16, 0, 3);  /* (its GC header: one line before) */
        __builtin_prefetch((char *)nx + 64, 0, 3);
    }
#else
    (void)child;
#endif
}

/* The descent both walks share: from head, follow the child whose whole key matches
 * buf[pos:n] (child_at + key_matches), calling visit(child, ctx) on each. Sets the bytes
 * matched, the last matched node (borrowed; head if none) and the split candidate
 * (borrowed, or Py_None). 0, or -1 with an error set. */
typedef int (*visit_fn)(PyObject *child, void *ctx);

static int descend(PyObject *head, const char *buf, Py_ssize_t n, Py_ssize_t pb, visit_fn visit, void *ctx,
                   Py_ssize_t *pos_out, PyObject **node_out, PyObject **split) {
    PyObject *node = head;
    Py_ssize_t pos = 0;
    *split = Py_None;
    while (pos < n) {
        PyObject *child = child_at(node, buf, pos, pb);
        if (child == NULL) {
            if (PyErr_Occurred())
                return -1;
            break;
        }
        prefetch_next(child);
        if (!key_matches(child, buf, pos, n, pb, split))
            break;
        if (visit(child, ctx) < 0)
            return -1;
        pos += PyBytes_GET_SIZE(SLOT(child, off_kbuf));
        node = child;
    }
    *pos_out = pos;
    *node_out = node;
    return 0;
}

/* Room for one more in a pointer array that starts in a fixed inline buffer ``stack``:
 * doubles ``*cap`` into heap memory when ``n == *cap`` (freeing an earlier heap block).
 * 0, or -1 with MemoryError set (the array unchanged). */
static int ptrs_reserve(PyObject ***items, PyObject **stack, Py_ssize_t n, Py_ssize_t *cap) {
    if (n < *cap)
        return 0;
    PyObject **grown = PyMem_Malloc(sizeof(PyObject *) * (size_t)*cap * 2);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(grown, *items, sizeof(PyObject *) * (size_t)n);
    if (*items != stack)
        PyMem_Free(*items);
    *items = grown;
    *cap *= 2;
    return 0;
}

/* A growable array of owned references (insert's matched path, the touched nodes' vbufs). */
typedef struct {
    PyObject **items;
    Py_ssize_t n, cap;
    PyObject *stack[32];
} node_vec;

static void node_vec_init(node_vec *v) {
    v->items = v->stack;
    v->n = 0;
    v->cap = 32;
}

static void node_vec_clear(node_vec *v) {
    for (Py_ssize_t i = 0; i < v->n; i++)
        Py_DECREF(v->items[i]);
    if (v->items != v->stack)
        PyMem_Free(v->items);
    node_vec_init(v);
}

/* Append a new reference to o. 0, or -1 with MemoryError set (v unchanged). */
static int node_vec_push(node_vec *v, PyObject *o) {
    if (ptrs_reserve(&v->items, v->stack, v->n, &v->cap) < 0)
        return -1;
    v->items[v->n++] = Py_NewRef(o);
    return 0;
}

/* The nodes as a new list (new reference), or NULL with an error set. */
static PyObject *node_vec_list(node_vec *v) {
    PyObject *l = PyList_New(v->n);
    if (l != NULL)
        for (Py_ssize_t i = 0; i < v->n; i++)
            PyList_SET_ITEM(l, i, Py_NewRef(v->items[i]));
    return l;
}

typedef struct {
    long long tick;
    node_vec vals;  /* the touched nodes' vbufs */
} touch_ctx;

/* walk's visit: touch the node (last_access = ++tick, hits += 1), keep its vbuf. */
static int touch(PyObject *child, void *p) {
    touch_ctx *c = (touch_ctx *)p;
    PyObject *hits = SLOT(child, off_hits), *vb = SLOT(child, off_vbuf);
    if (hits == NULL || !PyLong_CheckExact(hits) || vb == NULL || !PyBytes_CheckExact(vb)) {
        PyErr_SetString(PyExc_TypeError, "walk: a node's hits is not an int or its vbuf not bytes");
        return -1;
    }
    long long h = PyLong_AsLongLong(hits);
    if ((h == -1 && PyErr_Occurred()) || set_int_slot(child, off_last, c->tick + 1) < 0 ||
        set_int_slot(child, off_hits, h + 1) < 0)
        return -1;
    c->tick++;
    return node_vec_push(&c->vals, vb);
}

PyDoc_STRVAR(walk_doc,
"walk(head, buf, n, pb, tick) -> (pos, node, tick, rows, split)\n\n"
"match_prefix's walk: from head, follow the child whose key matches buf[pos:n] whole\n"
"(node.only, else children[buf[pos:pos+pb]]), touching each (tick += 1; last_access =\n"
"tick; hits += 1). Stops at a missing child, a child that differs, or one that runs past\n"
"n; split is that child when its first page matches (the caller splits it), else None.\n"
"pos: bytes matched; node: the last matched node (head if none); rows: with split None,\n"
"an int64 tensor of the matched nodes' rows, else the list of their vbufs.");

static void touch_init(touch_ctx *c, long long tick) {
    c->tick = tick;
    node_vec_init(&c->vals);
}

/* walk() on checked C arguments. */
static PyObject *walk_at(PyObject *head, PyObject *buf, Py_ssize_t n, Py_ssize_t pb, long long tick) {
    Py_ssize_t pos;
    touch_ctx c;
    touch_init(&c, tick);
    PyObject *node, *split, *rows = NULL, *res = NULL;
    if (descend(head, PyBytes_AS_STRING(buf), n, pb, touch, &c, &pos, &node, &split) == 0) {
        Py_INCREF(node);  /* owned from here: widen() may run Python code (a GC pass) */
        Py_INCREF(split);
        rows = split == Py_None ? widen(c.vals.items, c.vals.n, pos >> 2) : node_vec_list(&c.vals);
        PyObject *po = PyLong_FromSsize_t(pos), *tk = PyLong_FromLongLong(c.tick);
        if (rows != NULL && po != NULL && tk != NULL && (res = PyTuple_New(5)) != NULL) {
            /* (pos, node, tick, rows, split); a tuple filled directly (Py_BuildValue parses
             * its format on every call: ~3 us a thousand calls) */
            PyTuple_SET_ITEM(res, 0, po);
            PyTuple_SET_ITEM(res, 1, node);
            PyTuple_SET_ITEM(res, 2, tk);
            PyTuple_SET_ITEM(res, 3, rows);
            PyTuple_SET_ITEM(res, 4, split);
        } else {
            Py_XDECREF(po);
            Py_XDECREF(tk);
            Py_XDECREF(rows);
            Py_DECREF(node);
            Py_DECREF(split);
        }
    }
    node_vec_clear(&c.vals);
    return res;
}

static PyObject *walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t n, pb;
    if (walk_args(args, nargs, 5, &n, &pb) < 0)
        return NULL;
    long long tick = PyLong_AsLongLong(args[4]);
    if (tick == -1 && PyErr_Occurred())
        return NULL;
    return walk_at(args[0], args[1], n, pb, tick);
}

/* descend's visit for insert: keep the node (owned). */
static int collect(PyObject *child, void *p) { return node_vec_push((node_vec *)p, child); }

static int append_path(PyObject *child, void *path) { return PyList_Append((PyObject *)path, child); }

PyDoc_STRVAR(find_doc,
"find(head, buf, n, pb) -> (pos, node, path, split)\n\n"
"insert's read-only walk: walk's descent without touching anything. path: the fully\n"
"matched nodes in order.");

/* find() on checked C arguments (insert.c calls it directly). */
static PyObject *find_at(PyObject *head, PyObject *buf, Py_ssize_t n, Py_ssize_t pb) {
    Py_ssize_t pos;
    PyObject *node, *split, *path = PyList_New(0);
    if (path == NULL)
        return NULL;
    if (descend(head, PyBytes_AS_STRING(buf), n, pb, append_path, path, &pos, &node, &split) < 0) {
        Py_DECREF(path);
        return NULL;
    }
    PyObject *po = PyLong_FromSsize_t(pos), *res = NULL;
    if (po != NULL && (res = PyTuple_New(4)) != NULL) {  /* (pos, node, path, split) */
        PyTuple_SET_ITEM(res, 0, po);
        PyTuple_SET_ITEM(res, 1, Py_NewRef(node));
        PyTuple_SET_ITEM(res, 2, path);
        PyTuple_SET_ITEM(res, 3, Py_NewRef(split));
    } else {
        Py_XDECREF(po);
        Py_DECREF(path);
    }
    return res;
}

static PyObject *find(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t n, pb;
    if (walk_args(args, nargs, 4, &n, &pb) < 0)
        return NULL;
    return find_at(args[0], args[1], n, pb);
}
