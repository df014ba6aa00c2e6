"""The manager the vLLM connector's vLLM-free tests share (``manager``: a server thread on a
Unix socket, KV shape of ``tooling.vllm_fake``, ``.cfg`` its ``ConnectorConfig``)."""
import pytest
from tooling.testing import ThreadedServer
from tooling.vllm_fake import BS, HD, HEADS, LAYERS

from radixkv.engine.config import EngineConfig
from radixkv.integrations.vllm.config import ConnectorConfig


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    cfg = EngineConfig(kv_tokens=64, page_size=BS, layer_types="F" * LAYERS, head_num=HEADS, head_dim=HD,
                       kv_dtype="float32", request_rows=8, max_context_len=128)
    with ThreadedServer(cfg) as srv:
        tok = tmp_path_factory.mktemp("tok") / "token"
        tok.write_text(srv.token)
        srv.cfg = ConnectorConfig(address=srv.address, token_file=str(tok), retry_interval_s=0.05)
        yield srv
