"""The radix tree read back page by page, for the state machines of tests/cache (read-only)."""


def walk_pages(head, page_size):
    """Yield ``(node, prefix tuple at its end, {page prefix tuple: rows of that page})`` for
    every node under ``head``, parents before children. O(tokens under ``head``)."""
    stack = [(head, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            toks, rows = child.key.tolist(), child.value.tolist()
            p, pages = prefix, {}
            for i in range(0, len(toks), page_size):
                p = p + tuple(toks[i:i + page_size])
                pages[p] = tuple(rows[i:i + page_size])
            yield child, p, pages
            stack.append((child, p))
