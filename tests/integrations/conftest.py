"""The managers the vLLM connector's vLLM-free tests share: server threads on Unix sockets with
the KV shapes of ``benchmarks/tooling/vllm_fake.py`` (``manager``: MHA; ``mla_manager``: an MLA latent pool),
each with ``.cfg``, its ``ConnectorConfig``."""
import pytest
from tooling.vllm_fake import BS, HD, HEADS, LATENT, LAYERS, connector_manager

from radixkv.engine.config import EngineConfig


def _serve(tmp_path_factory, **shape):
    cfg = EngineConfig(kv_tokens=64, page_size=BS, layer_types="F" * LAYERS, kv_dtype="float32", request_rows=8,
                       max_context_len=128, **shape)
    srv = connector_manager(cfg, tmp_path_factory)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    yield from _serve(tmp_path_factory, head_num=HEADS, head_dim=HD)


@pytest.fixture(scope="module")
def mla_manager(tmp_path_factory):
    yield from _serve(tmp_path_factory, head_num=1, head_dim=LATENT, kv_lora_rank=LATENT - 4, qk_rope_head_dim=4)
