"""``vllm_miss_timeline.split_request``: a request's hook spans split into its own path and the
work it leaves behind, counted (steps, hooks), never timed."""
import pytest
from vllm_miss_timeline import split_request

#: a deferred miss: matched with no call, its step, finished; one more step saves it after
DEFERRED = [("get_num_new_matched_tokens", 1.0, 0.0002), ("update_state_after_alloc", 1.1, 0.0),
            ("build_connector_meta", 1.2, 0.0001), ("wait_for_save", 1.3, 0.0),
            ("request_finished", 1.4, 0.0), ("build_connector_meta", 1.5, 0.0001),
            ("wait_for_save", 1.6, 0.0005), ("get_num_new_matched_tokens", 2.0, 0.0003)]


def test_the_path_ends_at_request_finished_and_the_rest_is_left_behind():
    out = split_request([("build_connector_meta", -0.5, 0.001), *DEFERRED])   # an earlier request's step
    assert (out["path_steps"], out["after_steps"]) == (1, 1)
    assert out["path_ms"] == pytest.approx(0.3)
    assert out["after_ms"] == pytest.approx(0.6)                             # up to the next request's match
    assert out["path_hooks_ms"]["get_num_new_matched_tokens"] == pytest.approx(0.2)
    assert set(out["path_hooks_ms"]) == {"get_num_new_matched_tokens", "update_state_after_alloc",
                                         "build_connector_meta", "wait_for_save", "request_finished"}


def test_a_synchronous_miss_has_its_save_in_its_own_step():
    sync = [("get_num_new_matched_tokens", 0.0, 0.004), ("build_connector_meta", 0.01, 0.0001),
            ("wait_for_save", 0.02, 0.0006), ("request_finished", 0.03, 0.0)]
    out = split_request(sync)
    assert (out["path_steps"], out["after_steps"], out["after_ms"]) == (1, 0, 0.0)
    assert out["path_hooks_ms"]["wait_for_save"] == pytest.approx(0.6)


def test_no_spans():
    assert split_request([]) == {"path_ms": 0.0, "after_ms": 0.0, "path_steps": 0, "after_steps": 0,
                                 "path_hooks_ms": {}}
