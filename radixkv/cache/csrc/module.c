/* radixkv.cache._native: the RadixCache's hot paths, compiled.
 *
 * Optional: setup.py builds it when a C compiler is present, and radixkv.cache.native falls
 * back to the pure-Python code (which stays the contract and the reference) when it is
 * absent or RADIXKV_PURE_PYTHON is set. tests/cache/test_native_walk.py runs a compiled and a pure
 * cache in lockstep and compares every result and every node after every step.
 *
 * Parts: nodes.c (TreeNode slot offsets, new_node), rows.c (pooled int64 results, int32
 * narrowing), pagekeys.c (shared first-page keys of the children dicts), walk.c (the
 * descent: walk for match_prefix, find for insert), match.c and insert.c (the two methods
 * whole for their common case; every other call goes to Python before anything changes).
 *
 * Nodes are radixkv.cache.tree_node.TreeNode objects (__slots__): bind() looks up the slots'
 * offsets once, and the walks read and write those slots directly. Nothing in a descent runs
 * Python code, so the borrowed references it follows stay valid; what it keeps past that
 * point is owned.
 *
 * Costs: O(d) dict probes and memcmp over the matched bytes (d = nodes on the path); the
 * int32 -> int64 widening and the range check + narrowing are single vectorised passes.
 */

/* One translation unit: the parts below share static state (the node class, slot offsets,
 * cached callables) and are compiled together; each file holds one piece. */
#include "common.h"
#include "nodes.c"
#include "rows.c"
#include "pagekeys.c"
#include "walk.c"
#include "attrs.c"
#include "split.c"
#include "match.c"
#include "insert.c"

PyDoc_STRVAR(method_doc, "method(f): f wrapped so that it binds as a method (PyInstanceMethod).");

static PyObject *method(PyObject *self, PyObject *f) { return PyInstanceMethod_New(f); }

static PyMethodDef methods[] = {
    {"bind_split", bind_split, METH_VARARGS, bind_split_doc},
    {"bind_metrics", bind_metrics, METH_O, bind_metrics_doc},
    {"bind_leaves", bind_leaves, METH_VARARGS, bind_leaves_doc},
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
