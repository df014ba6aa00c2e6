"""Helpers of the hybrid tree's state machines: the tree read back as plain dicts, and the
model side's prefix arithmetic (``self.kv``: page-aligned prefix -> rows of its last page;
``self.states``: prefix ending at a node with a state -> what the test tracks of it)."""
from hypothesis import strategies as st
from tree_walk import walk_pages

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=12)


def tree_pages(cache, node_state):
    """{prefix tuple: rows of its last page}, {node-end prefix tuple: node_state(node)} for
    the nodes where ``node_state`` is not None. Read-only."""
    kv, states = {}, {}
    for child, p, pages in walk_pages(cache.root_node, cache.page_size):
        kv.update(pages)
        s = node_state(child)
        if s is not None:
            states[p] = s
    return kv, states


class PrefixModel:
    """The model side of a hybrid state machine (mixed into a RuleBasedStateMachine that has
    ``page_size``, ``kv`` and ``states``)."""

    def aligned(self, tokens):
        return tuple(tokens[: len(tokens) - len(tokens) % self.page_size])

    def expect_match(self, tokens):
        """(state hit, KV hit, rows of the state hit) the model predicts for ``tokens``."""
        ps, key = self.page_size, self.aligned(tokens)
        n = 0
        while n + ps <= len(key) and key[: n + ps] in self.kv:
            n += ps
        s = max([len(p) for p in self.states if len(p) <= n and key[: len(p)] == p] or [0])
        rows = [r for i in range(ps, s + 1, ps) for r in self.kv[key[:i]]]
        return s, n, rows

    def draw_tokens(self, data):
        """Random tokens, or (mostly) a cached prefix / state prefix plus a random tail."""
        known = sorted(self.states) + sorted(self.kv)
        if known and data.draw(st.integers(0, 3)):
            return list(data.draw(st.sampled_from(known))) + data.draw(st.lists(st.integers(0, 3), max_size=4))
        return data.draw(TOKENS)
