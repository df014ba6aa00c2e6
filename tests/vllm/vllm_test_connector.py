"""A ``RadixKVConnector`` that, while the file ``$RADIXKV_TEST_EVICT_FLAG`` exists, asks the
manager to evict everything it can right after each match that found a hit, before vLLM
loads it: the test of "an eviction between match and load"."""
import os

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
