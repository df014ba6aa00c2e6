/* radixkv.cache._native, nodes.c: TreeNode slot offsets (bind), int slot writes, new_node.
 * (part of one translation unit: module.c includes it; see module.c) */


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

PyDoc_STRVAR(bind_doc, "bind(node_type, from_dlpack): set the node class and torch._C._from_dlpack, which "
                       "makes a match's int64 tensor (rows.c). Call once, before any walk.");

static PyObject *bind(PyObject *self, PyObject *args) {
    PyObject *nt, *fdl;
    if (!PyArg_ParseTuple(args, "O!O", &PyType_Type, &nt, &fdl))
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
    Py_INCREF(fdl); Py_XSETREF(from_dlpack, fdl);
    Py_RETURN_NONE;
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

