/* radixkv.cache._native, pagekeys.c: the children dicts' keys (a page's bytes), shared.
 * (part of one translation unit: module.c includes it; see module.c)
 *
 * Why: a walk looks up a child by its first page, children[buf[pos:pos+pb]], at every node
 * with more than one child; a fresh bytes key there costs an allocation, a free and a siphash
 * per lookup, and comparing it with the dict's stored key reads that key (a cache miss, the
 * stored keys are scattered over the heap). A small direct-mapped table keeps one bytes
 * object per recent page: a lookup with a table key hashes nothing (bytes cache their hash)
 * and, when the dict's key is that very object (the compiled insert and split file children
 * under table keys), the dict matches it by identity, reading nothing more.
 *
 * The table only ever holds exact bytes objects equal to the page they are filed under
 * (compared in full on every use), so a key from it is equal to a fresh one in every way;
 * nothing but this file writes the table, and only under the GIL. Memory: PK_SLOTS
 * references, each to a small bytes object (<= ~200 KiB in all at page size 1). */

#define PK_BITS 12
#define PK_SLOTS (1 << PK_BITS)
#define PK_MAX_BYTES 256 /* longer pages (page_size > 64) get fresh keys */
static PyObject *pk_table[PK_SLOTS];

/* The table slot of the pb bytes at p (pb a positive multiple of 4). */
static inline uint32_t pk_slot(const char *p, Py_ssize_t pb) {
    uint64_t h = 0x243F6A8885A308D3ull;
    for (Py_ssize_t i = 0; i < pb; i += 4) {
        uint32_t w;
        memcpy(&w, p + i, 4);
        h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    }
    return (uint32_t)(h >> (64 - PK_BITS));
}

/* bytes(p[0:pb]) (new reference), from the table when it holds it (else a new one, filed
 * there); NULL with an error set. */
static PyObject *page_key(const char *p, Py_ssize_t pb) {
    if (pb > PK_MAX_BYTES)
        return PyBytes_FromStringAndSize(p, pb);
    PyObject **slot = &pk_table[pk_slot(p, pb)], *k = *slot;
    if (k != NULL && PyBytes_GET_SIZE(k) == pb && memcmp(PyBytes_AS_STRING(k), p, (size_t)pb) == 0)
        return Py_NewRef(k);
    if ((k = PyBytes_FromStringAndSize(p, pb)) == NULL)
        return NULL;
    Py_XSETREF(*slot, Py_NewRef(k));  /* (the old key's dealloc runs no Python code) */
    return k;
}
