/* radixkv.cache._native: the RadixCache's two hot walks and its row narrowing, compiled.
 *
 * Optional: setup.py builds it when a C compiler is present, and radixkv.cache.native
 * falls back to the pure-Python paths (which stay the reference) when it is absent or
 * RADIXKV_PURE_PYTHON is set. Each function does exactly what the Python code it
 * replaces does (radix_cache.match_prefix's walk, radix_insert.insert's read-only walk,
 * rows.rows_bytes for a contiguous int64 array); tests/test_native_walk.py checks that
 * both paths agree on random trees.
 *
 * Nodes are radixkv.cache.tree_node.TreeNode objects (__slots__): bind() looks up the
 * slots' offsets once, and the walks read and write those slots directly. Nothing in a
 * walk runs Python code until the node loop is over, so the borrowed references it
 * follows stay valid; the rows it keeps are owned references.
 *
 * Costs: walk and find O(d) dict probes / memcmp over the matched bytes (d = nodes on the
 * path); the int32 -> int64 widening and the range check + narrowing are single passes
 * the compiler vectorises.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

static PyTypeObject *node_type = NULL;
static Py_ssize_t off_kbuf, off_only, off_children, off_vbuf, off_last, off_hits;
static Py_ssize_t off_skey, off_lock, off_parent, off_prio, off_created, off_id, off_hashes, off_pstate;
static PyObject *np_empty = NULL, *i64_dtype = NULL, *from_numpy = NULL;

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* The two bulk loops get an AVX2 clone next to the baseline one (x86-64's baseline has no
 * packed int32 <-> int64 conversion); the loader picks one per CPU (GNU ifunc). */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define BULK_LOOP __attribute__((target_clones("avx2", "default")))
#else
#define BULK_LOOP
#endif

/* out[i] = src[i] for i < m (int32 -> int64). */
BULK_LOOP static void widen_rows(int64_t *restrict out, const int32_t *restrict src, Py_ssize_t m) {
    for (Py_ssize_t i = 0; i < m; i++)
        out[i] = src[i];
}

/* dst[i] = (int32)src[i] for i < m; returns the OR of every src[i] (as unsigned), whose
 * bits >= 31 are all clear exactly when every src[i] lies in [0, 2**31). */
BULK_LOOP static uint64_t narrow_rows(int32_t *restrict dst, const int64_t *restrict src, Py_ssize_t m) {
    uint64_t acc = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        acc |= (uint64_t)src[i];
        dst[i] = (int32_t)src[i];
    }
    return acc;
}

static int slot_offset(PyTypeObject *t, const char *name, Py_ssize_t *off) {
    PyObject *d = PyDict_GetItemString(t->tp_dict, name);
    if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type ||
        ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not an object slot", t->tp_name, name);
        return -1;
    }
    *off = ((PyMemberDescrObject *)d)->d_member->offset;
    return 0;
}

PyDoc_STRVAR(bind_doc, "bind(node_type, np_empty, int64_dtype, from_numpy): set the node class and the "
                       "callables that build a match's int64 tensor. Call once, before any walk.");

static PyObject *bind(PyObject *self, PyObject *args) {
    PyObject *nt, *emp, *dt, *fnp;
    if (!PyArg_ParseTuple(args, "O!OOO", &PyType_Type, &nt, &emp, &dt, &fnp))
        return NULL;
    static const char *names[14] = {"kbuf", "only", "children", "vbuf", "last_access", "hits", "skey",
                                    "lock_ref", "parent", "priority", "created", "id", "block_hashes", "pstate"};
    Py_ssize_t offs[14];
    PyTypeObject *t = (PyTypeObject *)nt;
    for (int i = 0; i < 14; i++)
        if (slot_offset(t, names[i], &offs[i]))
            return NULL;
    if (t->tp_basicsize != (Py_ssize_t)(sizeof(PyObject) + 14 * sizeof(PyObject *))) {
        PyErr_Format(PyExc_TypeError, "%s has other fields than its 14 slots", t->tp_name);
        return NULL;
    }
    off_kbuf = offs[0]; off_only = offs[1]; off_children = offs[2]; off_vbuf = offs[3];
    off_last = offs[4]; off_hits = offs[5]; off_skey = offs[6]; off_lock = offs[7];
    off_parent = offs[8]; off_prio = offs[9]; off_created = offs[10]; off_id = offs[11];
    off_hashes = offs[12]; off_pstate = offs[13];
    Py_INCREF(nt); Py_XSETREF(node_type, t);
    Py_INCREF(emp); Py_XSETREF(np_empty, emp);
    Py_INCREF(dt); Py_XSETREF(i64_dtype, dt);
    Py_INCREF(fnp); Py_XSETREF(from_numpy, fnp);
    Py_RETURN_NONE;
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
    *pb = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return -1;
    if (*pb < 4 || (*pb & 3) || *n < 0 || *n > PyBytes_GET_SIZE(args[1]) || *n % *pb) {
        PyErr_SetString(PyExc_ValueError, "walk: need 0 <= n <= len(buf), n a multiple of pb, pb a multiple of 4");
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
        PyObject *k = PyBytes_FromStringAndSize(buf + pos, pb);
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

static int set_int_slot(PyObject *o, Py_ssize_t off, long long v) {
    PyObject *x = PyLong_FromLongLong(v);
    if (x == NULL)
        return -1;
    PyObject *old = SLOT(o, off);
    SLOT(o, off) = x;
    Py_XDECREF(old);
    return 0;
}

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
 * the pool, *pooled = 1) or a new one of exactly ntok (new reference, *pooled = 0). */
static PyObject *result_array(Py_ssize_t ntok, int *pooled) {
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
                Py_XSETREF(pool[c][i], arr);  /* (XSETREF: np.empty may have run a GC pass) */
            }
            if (Py_REFCNT(arr) == 1) {
                *pooled = 1;
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
    PyObject *arr = result_array(ntok, &pooled);
    if (arr == NULL)
        return NULL;
    if (pooled)
        Py_INCREF(arr);
    Py_buffer view;
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
    int64_t *out = (int64_t *)view.buf;
    for (Py_ssize_t i = 0; i < nv; i++) {
        Py_ssize_t m = PyBytes_GET_SIZE(vals[i]) >> 2;
        widen_rows(out, (const int32_t *)PyBytes_AS_STRING(vals[i]), m);
        out += m;
    }
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

typedef struct {
    long long tick;
    PyObject **vals;  /* owned references to the touched nodes' vbufs */
    Py_ssize_t nv, cap;
    PyObject *stack[32];
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
    if (c->nv == c->cap) {
        PyObject **grown = PyMem_Malloc(sizeof(PyObject *) * (size_t)c->cap * 2);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(grown, c->vals, sizeof(PyObject *) * (size_t)c->nv);
        if (c->vals != c->stack)
            PyMem_Free(c->vals);
        c->vals = grown;
        c->cap *= 2;
    }
    Py_INCREF(vb);
    c->vals[c->nv++] = vb;
    return 0;
}

PyDoc_STRVAR(walk_doc,
"walk(head, buf, n, pb, tick) -> (pos, node, tick, rows, split)\n\n"
"match_prefix's walk: from head, follow the child whose key matches buf[pos:n] whole\n"
"(node.only, else children[buf[pos:pos+pb]]), touching each (tick += 1; last_access =\n"
"tick; hits += 1). Stops at a missing child, a child that differs, or one that runs past\n"
"n; split is that child when its first page matches (the caller splits it), else None.\n"
"pos: bytes matched; node: the last matched node (head if none); rows: with split None,\n"
"an int64 tensor of the matched nodes' rows, else the list of their vbufs.");

static PyObject *walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t n, pb, pos;
    if (walk_args(args, nargs, 5, &n, &pb) < 0)
        return NULL;
    touch_ctx c;
    c.tick = PyLong_AsLongLong(args[4]);
    if (c.tick == -1 && PyErr_Occurred())
        return NULL;
    c.vals = c.stack;
    c.nv = 0;
    c.cap = 32;
    PyObject *node, *split, *rows = NULL, *res = NULL;
    if (descend(args[0], PyBytes_AS_STRING(args[1]), n, pb, touch, &c, &pos, &node, &split) == 0) {
        Py_INCREF(node);  /* owned from here: widen() may run Python code (a GC pass) */
        Py_INCREF(split);
        if (split == Py_None) {
            rows = widen(c.vals, c.nv, pos >> 2);
        } else if ((rows = PyList_New(c.nv)) != NULL) {
            for (Py_ssize_t i = 0; i < c.nv; i++) {
                Py_INCREF(c.vals[i]);
                PyList_SET_ITEM(rows, i, c.vals[i]);
            }
        }
        if (rows != NULL) {
            res = Py_BuildValue("(nNLNN)", pos, node, c.tick, rows, split);
        } else {
            Py_DECREF(node);
            Py_DECREF(split);
        }
    }
    for (Py_ssize_t i = 0; i < c.nv; i++)
        Py_DECREF(c.vals[i]);
    if (c.vals != c.stack)
        PyMem_Free(c.vals);
    return res;
}

static int append_path(PyObject *child, void *path) { return PyList_Append((PyObject *)path, child); }

PyDoc_STRVAR(find_doc,
"find(head, buf, n, pb) -> (pos, node, path, split)\n\n"
"insert's read-only walk: walk's descent without touching anything. path: the fully\n"
"matched nodes in order.");

static PyObject *find(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t n, pb, pos;
    if (walk_args(args, nargs, 4, &n, &pb) < 0)
        return NULL;
    PyObject *node, *split, *path = PyList_New(0);
    if (path == NULL)
        return NULL;
    if (descend(args[0], PyBytes_AS_STRING(args[1]), n, pb, append_path, path, &pos, &node, &split) < 0) {
        Py_DECREF(path);
        return NULL;
    }
    return Py_BuildValue("(nONO)", pos, node, path, split);
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

PyDoc_STRVAR(new_node_doc,
"new_node(node_id, parent, kbuf, vbuf, tick, priority) -> TreeNode\n\n"
"TreeNode(node_id, parent, kbuf, vbuf, tick, priority) without running __init__ in Python:\n"
"the same fields (children {}, only None, lock_ref 0, last_access = created = tick, hits 0,\n"
"skey / block_hashes / pstate None).");

static PyObject *new_node(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (node_type == NULL || nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "new_node(node_id, parent, kbuf, vbuf, tick, priority) after bind()");
        return NULL;
    }
    PyObject *children = PyDict_New();
    if (children == NULL)
        return NULL;
    PyObject *node = node_type->tp_alloc(node_type, 0);
    if (node == NULL) {
        Py_DECREF(children);
        return NULL;
    }
    PyObject *zero = PyLong_FromLong(0);
    SLOT(node, off_children) = children;
    SLOT(node, off_only) = Py_NewRef(Py_None);
    SLOT(node, off_parent) = Py_NewRef(args[1]);
    SLOT(node, off_kbuf) = Py_NewRef(args[2]);
    SLOT(node, off_vbuf) = Py_NewRef(args[3]);
    SLOT(node, off_lock) = Py_NewRef(zero);
    SLOT(node, off_last) = Py_NewRef(args[4]);
    SLOT(node, off_created) = Py_NewRef(args[4]);
    SLOT(node, off_hits) = zero;
    SLOT(node, off_prio) = Py_NewRef(args[5]);
    SLOT(node, off_skey) = Py_NewRef(Py_None);
    SLOT(node, off_id) = Py_NewRef(args[0]);
    SLOT(node, off_hashes) = Py_NewRef(Py_None);
    SLOT(node, off_pstate) = Py_NewRef(Py_None);
    return node;
}

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
"RadixCache._match_prefix_py, the contract and the reference. This compiled entry takes the\n"
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
    Py_ssize_t pb = PyLong_AsSsize_t(pbo), nbytes = PyBytes_GET_SIZE(buf);
    if (pb == -1 && PyErr_Occurred())
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
    PyObject *wargs[5];
    wargs[0] = head;
    wargs[1] = buf;
    wargs[2] = PyLong_FromSsize_t(n);
    wargs[3] = pbo;
    wargs[4] = clock;
    if (wargs[2] == NULL)
        goto done;
    w = walk(NULL, wargs, 5);
    Py_DECREF(wargs[2]);
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
        PyObject *q = Py_BuildValue("(nn)", nbytes >> 2, pos >> 2);
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

/* ---------------------------------------------------------------- insert, whole */

static PyObject *py_insert = NULL;  /* radix_insert.insert (the reference) */
static PyObject *t_int64 = NULL, *t_tensor = NULL;
static PyObject *s_kv_events, *s_on_insert, *s_lazy, *s_dtype, *s_ndim, *s_is_cpu, *s_is_contiguous,
    *s_is_neg, *s_data_ptr, *s_next_id, *s_leaves, *s_remove, *s_add, *s_evictable, *s_sort_key, *s_inserts,
    *s_inserted_tokens;

PyDoc_STRVAR(bind_insert_doc, "bind_insert(py_insert, torch.Tensor, torch.int64): the Python insert "
                              "that insert() hands every case it does not take itself.");

static PyObject *bind_insert(PyObject *self, PyObject *args) {
    PyObject *f, *tt, *i64;
    if (!PyArg_ParseTuple(args, "OO!O", &f, &PyType_Type, &tt, &i64))
        return NULL;
#define INTERN(v, s) if ((v = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(s_kv_events, "kv_events"); INTERN(s_on_insert, "_on_insert"); INTERN(s_lazy, "_lazy");
    INTERN(s_dtype, "dtype"); INTERN(s_ndim, "ndim"); INTERN(s_is_cpu, "is_cpu");
    INTERN(s_is_contiguous, "is_contiguous"); INTERN(s_is_neg, "is_neg"); INTERN(s_data_ptr, "data_ptr");
    INTERN(s_next_id, "_next_id"); INTERN(s_leaves, "_leaves"); INTERN(s_remove, "remove");
    INTERN(s_add, "add"); INTERN(s_evictable, "_evictable"); INTERN(s_sort_key, "_sort_key");
    INTERN(s_inserts, "inserts"); INTERN(s_inserted_tokens, "inserted_tokens");
#undef INTERN
    Py_INCREF(f); Py_XSETREF(py_insert, f);
    Py_INCREF(tt); Py_XSETREF(t_tensor, tt);
    Py_INCREF(i64); Py_XSETREF(t_int64, i64);
    Py_RETURN_NONE;
}

/* o.name += delta for an int attribute. */
static int add_to_attr(PyObject *o, PyObject *name, Py_ssize_t delta) {
    PyObject *v = PyObject_GetAttr(o, name), *d = NULL, *r = NULL;
    if (v != NULL && (d = PyLong_FromSsize_t(delta)) != NULL)
        r = PyNumber_Add(v, d);
    Py_XDECREF(v);
    Py_XDECREF(d);
    if (r == NULL)
        return -1;
    int rc = PyObject_SetAttr(o, name, r);
    Py_DECREF(r);
    return rc;
}

/* 1 when getattr(o, name) is True, 0 when it is False, 2 otherwise, -1 on error. */
static int attr_bool(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    int r = v == Py_True ? 1 : v == Py_False ? 0 : 2;
    Py_DECREF(v);
    return r;
}

/* 1 when o.name() is True, 0 when False, 2 otherwise, -1 on error. */
static int call_bool(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_CallMethodNoArgs(o, name);
    if (v == NULL)
        return -1;
    int r = v == Py_True ? 1 : v == Py_False ? 0 : 2;
    Py_DECREF(v);
    return r;
}

PyDoc_STRVAR(insert_doc,
"insert(key, value, priority=0, extra_key=None) -> int\n\n"
"Insert key (whole pages) with its KV rows; returns the tokens already cached: see\n"
"radixkv.cache.radix_insert.insert, the contract and the reference. This compiled entry\n"
"takes the common case whole (a RadixKey, a contiguous 1-D CPU int64 tensor, an int\n"
"priority, an existing namespace, no split, no KV events, a policy without hooks) and hands\n"
"every other call to it unchanged, before changing anything.");

static PyObject *insert(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *self, *key, *value, *prio, *res = NULL;
    PyObject *buf = NULL, *ek = NULL, *pbo = NULL, *heads = NULL, *head = NULL, *found = NULL, *tail = NULL,
        *leaf = NULL, *clock = NULL, *v = NULL;
    long long p = 0;
    if (py_insert == NULL || node_type == NULL || key_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "radixkv.cache._native: bind()/bind_match()/bind_insert() not called");
        return NULL;
    }
    if (kwnames != NULL || nargs < 3 || nargs > 4 || Py_TYPE(args[1]) != key_type ||
        Py_TYPE(args[2]) != (PyTypeObject *)t_tensor || (nargs == 4 && !PyLong_CheckExact(args[3])))
        return PyObject_Vectorcall(py_insert, args, nargs, kwnames);
    self = args[0];
    key = args[1];
    value = args[2];
    prio = nargs == 4 ? args[3] : NULL;
    if (prio != NULL) {
        int overflow;
        p = PyLong_AsLongLongAndOverflow(prio, &overflow);
        if (overflow || (p == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            goto python;
        }
    }
    /* the cache: compiled walks on, no KV events, no on_insert hook, a lazily kept order */
    if ((v = PyObject_GetAttr(self, s_cwalk)) == NULL)  /* _cwalk is set only for such policies */
        return NULL;
    int take = v != Py_None;
    Py_CLEAR(v);
    if (take) {
        if ((v = PyObject_GetAttr(self, s_kv_events)) == NULL)
            return NULL;
        take = v == Py_None;
        Py_CLEAR(v);
    }
    if (take) {
        if ((v = PyObject_GetAttr(self, s_on_insert)) == NULL)
            return NULL;
        take = v == Py_None;
        Py_CLEAR(v);
    }
    if (take && (take = attr_bool(self, s_disable)) >= 0)
        take = take == 0;
    if (take < 0)
        return NULL;
    if (!take)
        goto python;
    /* the value: 1-D CPU int64, one row per token */
    if ((v = PyObject_GetAttr(value, s_dtype)) == NULL)
        return NULL;
    take = v == t_int64;
    Py_CLEAR(v);
    if (take) {
        if ((v = PyObject_GetAttr(value, s_ndim)) == NULL)
            return NULL;
        take = PyLong_CheckExact(v) && PyLong_AsLong(v) == 1;
        Py_CLEAR(v);
    }
    if (take && (take = attr_bool(value, s_is_cpu)) >= 0)
        take = take == 1;
    if (take < 0)
        return NULL;
    if (!take)
        goto python;
    if ((buf = PyObject_GetAttr(key, s_buf)) == NULL || (ek = PyObject_GetAttr(key, s_extra_key)) == NULL ||
        (pbo = PyObject_GetAttr(self, s_pb)) == NULL || (heads = PyObject_GetAttr(self, s_heads)) == NULL)
        goto done;
    if (!PyBytes_CheckExact(buf) || !PyDict_CheckExact(heads))
        goto python;
    Py_ssize_t n = PyBytes_GET_SIZE(buf), pb = PyLong_AsSsize_t(pbo);
    if (pb == -1 && PyErr_Occurred())
        goto done;
    Py_ssize_t rows = PyObject_Size(value);
    if (rows < 0)
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
    PyObject *fargs[4];
    fargs[0] = head;
    fargs[1] = buf;
    fargs[2] = PyLong_FromSsize_t(n);
    fargs[3] = pbo;
    if (fargs[2] == NULL)
        goto done;
    found = find(NULL, fargs, 4);
    Py_DECREF(fargs[2]);
    if (found == NULL)
        goto done;
    if (PyTuple_GET_ITEM(found, 3) != Py_None)
        goto python;  /* the cached prefix ends inside a node: a split */
    Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(found, 0));
    PyObject *node = PyTuple_GET_ITEM(found, 1), *path = PyTuple_GET_ITEM(found, 2);
    if (pos < n) {  /* the new rows: contiguous, no neg bit, all in [0, 2**31) */
        int ok = call_bool(value, s_is_contiguous);
        if (ok == 1)
            ok = call_bool(value, s_is_neg) == 0;
        if (ok < 0)
            goto done;
        if (ok != 1)
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
    if ((clock = PyObject_GetAttr(self, s_clock)) == NULL)
        goto done;
    long long tick = PyLong_AsLongLong(clock);
    if (tick == -1 && PyErr_Occurred())
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(path); i++) {
        PyObject *x = PyList_GET_ITEM(path, i), *xp = SLOT(x, off_prio);
        if (set_int_slot(x, off_last, ++tick) < 0)
            goto done;
        long long xv = PyLong_AsLongLong(xp);
        if (xv == -1 && PyErr_Occurred())
            goto done;
        if (xv < p && set_int_slot(x, off_prio, p) < 0)
            goto done;
    }
    if (pos < n) {
        PyObject *ptail = NULL, *page = NULL, *idobj = NULL, *tk = NULL, *pr = NULL, *leaves = NULL, *r = NULL;
        int bad = add_to_attr(self, s_next_id, 1) < 0 || (idobj = PyObject_GetAttr(self, s_next_id)) == NULL ||
                  (ptail = PyBytes_FromStringAndSize(PyBytes_AS_STRING(buf) + pos, n - pos)) == NULL ||
                  (tk = PyLong_FromLongLong(++tick)) == NULL || (pr = PyLong_FromLongLong(p)) == NULL;
        if (!bad) {
            PyObject *nn[6] = {idobj, node, ptail, tail, tk, pr};
            bad = (leaf = new_node(NULL, nn, 6)) == NULL;
        }
        Py_XDECREF(ptail); Py_XDECREF(idobj); Py_XDECREF(tk); Py_XDECREF(pr);
        if (bad || (leaves = PyObject_GetAttr(self, s_leaves)) == NULL)
            goto done;
        if (SLOT(node, off_skey) != Py_None) {  /* the parent stops being a leaf */
            r = PyObject_CallMethodOneArg(leaves, s_remove, node);
            if (r == NULL) {
                Py_DECREF(leaves);
                goto done;
            }
            Py_CLEAR(r);
            Py_SETREF(SLOT(node, off_skey), Py_NewRef(Py_None));
        }
        PyObject *ch = SLOT(node, off_children);
        bad = (page = PyBytes_FromStringAndSize(PyBytes_AS_STRING(buf) + pos, pb)) == NULL ||
              PyDict_SetItem(ch, page, leaf) < 0;
        Py_XDECREF(page);
        if (!bad) {
            Py_SETREF(SLOT(node, off_only), Py_NewRef(PyDict_GET_SIZE(ch) == 1 ? leaf : Py_None));
            bad = add_to_attr(self, s_evictable, (n - pos) >> 2) < 0;
        }
        if (!bad) {  /* leaf.skey = cache._sort_key(leaf); leaves.add(leaf) */
            PyObject *sk = PyObject_GetAttr(self, s_sort_key), *kv = NULL;
            if (sk != NULL)
                kv = PyObject_CallOneArg(sk, leaf);
            Py_XDECREF(sk);
            if (kv == NULL)
                bad = 1;
            else
                Py_SETREF(SLOT(leaf, off_skey), kv);
        }
        if (!bad && (r = PyObject_CallMethodOneArg(leaves, s_add, leaf)) == NULL)
            bad = 1;
        Py_XDECREF(r);
        Py_DECREF(leaves);
        if (bad)
            goto done;
    }
    PyObject *tko = PyLong_FromLongLong(tick), *m = NULL;
    if (tko == NULL || PyObject_SetAttr(self, s_clock, tko) < 0) {
        Py_XDECREF(tko);
        goto done;
    }
    Py_DECREF(tko);
    if ((m = PyObject_GetAttr(self, s_metrics)) == NULL)
        goto done;
    if (add_to_attr(m, s_inserts, 1) < 0 || add_to_attr(m, s_inserted_tokens, (n - pos) >> 2) < 0) {
        Py_DECREF(m);
        goto done;
    }
    Py_DECREF(m);
    res = PyLong_FromSsize_t(pos >> 2);
    goto done;
python:
    res = PyObject_Vectorcall(py_insert, args, nargs, NULL);
done:
    Py_XDECREF(buf); Py_XDECREF(ek); Py_XDECREF(pbo); Py_XDECREF(heads); Py_XDECREF(head);
    Py_XDECREF(found); Py_XDECREF(tail); Py_XDECREF(leaf); Py_XDECREF(clock); Py_XDECREF(v);
    return res;
}

PyDoc_STRVAR(method_doc, "method(f): f wrapped so that it binds as a method (PyInstanceMethod).");

static PyObject *method(PyObject *self, PyObject *f) { return PyInstanceMethod_New(f); }

static PyMethodDef methods[] = {
    {"bind_insert", bind_insert, METH_VARARGS, bind_insert_doc},
    {"insert", (PyCFunction)(void (*)(void))insert, METH_FASTCALL | METH_KEYWORDS, insert_doc},
    {"pool_stats", pool_stats, METH_NOARGS, pool_stats_doc},
    {"bind_match", bind_match, METH_VARARGS, bind_match_doc},
    {"match_prefix", (PyCFunction)(void (*)(void))match, METH_FASTCALL | METH_KEYWORDS, match_doc},
    {"method", method, METH_O, method_doc},
    {"new_node", (PyCFunction)(void (*)(void))new_node, METH_FASTCALL, new_node_doc},
    {"bind", bind, METH_VARARGS, bind_doc},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL, walk_doc},
    {"find", (PyCFunction)(void (*)(void))find, METH_FASTCALL, find_doc},
    {"narrow", (PyCFunction)(void (*)(void))narrow, METH_FASTCALL, narrow_doc},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "radixkv.cache._native",
                                    "Compiled hot walks of the RadixCache (see radixkv.cache.native).",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
