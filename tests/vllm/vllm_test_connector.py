"""``RadixKVConnector``s with a fault switched on by a flag file, for the vLLM tests.

``EvictingRadixKVConnector``: while ``$RADIXKV_TEST_EVICT_FLAG`` exists, asks the manager to
evict everything it can right after each match that found a hit, before vLLM loads it: the test
of "an eviction between match and load". ``StateLoadFailingRadixKVConnector``: while
``$RADIXKV_TEST_FAIL_STATE_FLAG`` exists, the worker's recurrent-state loads fail (as a failed
copy does; one line per failed batch is appended to the flag file): the test of "a state load
that fails makes vLLM recompute"."""
import os

from radixkv.errors import InvalidArgumentError
from radixkv.integrations.vllm import RadixKVConnector


class EvictingRadixKVConnector(RadixKVConnector):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        flag = os.environ.get("RADIXKV_TEST_EVICT_FLAG")
        if n and flag and os.path.exists(flag):
            got = self._sched.link.get()
            if got is not None:
                client, info = got
                res = client.evict(info.session, 1 << 30)
                with open(flag, "a") as f:
                    f.write(f"{request.request_id} {res.tokens}\n")
        return n, load_async


class StateLoadFailingRadixKVConnector(RadixKVConnector):
    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        worker = self._worker
        copy_group = worker._copy_state_group

        def failing(wb, ops, to_vllm):
            flag = os.environ.get("RADIXKV_TEST_FAIL_STATE_FLAG")
            if to_vllm and flag and os.path.exists(flag):
                with open(flag, "a") as f:
                    f.write(" ".join(op.req_id for op in ops) + "\n")
                raise InvalidArgumentError("test: the state load failed")
            return copy_group(wb, ops, to_vllm)

        worker._copy_state_group = failing
