"""The worker's copies run with ``copy_threads`` torch intra-op threads on CPU, and leave the
process's (vLLM's) thread count as it was, even when a copy fails."""
import torch
from tooling.vllm_fake import Engine


def test_copies_run_narrow_and_restore_the_thread_count(manager):
    e = Engine(manager.cfg)
    seen = []
    e.worker._copy_ops = lambda ops, to_vllm: seen.append(torch.get_num_threads()) or ([], [])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        e.worker.load([])
        e.worker.copy_threads = 0  # torch's own setting
        e.worker.save([])

        def broken(ops, to_vllm):
            raise RuntimeError("copy failed")

        e.worker.copy_threads = 1
        e.worker._copy_ops = broken
        try:
            e.worker.load([])
        except RuntimeError:
            pass
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
        e.close()


def test_a_failed_warm_up_is_only_a_warning(manager, monkeypatch):
    from radixkv.integrations.vllm.worker_side import WorkerSide

    def broken(self, wb):
        raise RuntimeError("cannot touch the pool")

    monkeypatch.setattr(WorkerSide, "_warm", broken)
    e = Engine(manager.cfg)  # registers and maps all the same
    assert e.worker.counters["mapped_epochs"] == 1
    e.close()
