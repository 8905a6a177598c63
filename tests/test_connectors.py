"""KV connector rules (profiles/connectors.yaml via predict/features/connectors.py): release
gates read from the sdists, TP rules from the connectors' documentation, and each pool's
--kv-transfer-config and environment."""

from __future__ import annotations

import json

import pytest

from launcher.errors import InputError
from launcher.predict.features import connectors as C


def test_the_release_gates_follow_the_sdists():
    assert "NixlConnector" not in C.connectors_in("0.8.5")
    assert "NixlConnector" in C.connectors_in("0.9.0")
    assert "ExampleConnector" not in C.connectors_in("0.12.0")  # SharedStorageConnector then
    assert "ExampleConnector" in C.connectors_in("0.13.0")
    assert "P2pNcclConnector" in C.connectors_in("0.23.0")
    assert "P2pNcclConnector" not in C.connectors_in("0.24.0")  # gone from the factory
    assert not C.field_allowed("kv_load_failure_policy", "0.12.0")
    assert C.field_allowed("kv_load_failure_policy", "0.13.0")
    assert not C.field_allowed("kv_buffer_size", "0.32.0")


def test_a_connector_the_version_lacks_is_one_line():
    with pytest.raises(InputError, match=r"vLLM 0\.8\.5 has no NixlConnector .*0\.9\.0 and later"):
        C.check("NixlConnector", "0.8.5", 1, 1, mla=False)
    with pytest.raises(InputError, match="unknown KV connector"):
        C.check("NoSuchConnector", "0.32.0", 1, 1, mla=False)


@pytest.mark.parametrize("p_tp", [1, 2, 4, 8])
@pytest.mark.parametrize("d_tp", [1, 2, 4, 8])
@pytest.mark.parametrize("mla", [False, True])
def test_tp_rules(p_tp, d_tp, mla):
    def ok(name: str) -> bool:
        try:
            C.check(name, "0.32.0", p_tp, d_tp, mla)
            return True
        except InputError:
            return False

    # NixlConnector: decode TP >= prefill TP for non-MLA models; MLA moves at any pairing
    assert ok("NixlConnector") == (mla or d_tp >= p_tp)
    # MooncakeConnector: the same TP on both sides, MLA or not
    assert ok("MooncakeConnector") == (p_tp == d_tp)


def test_each_pool_gets_its_config_and_env():
    t = C.pool_transfers("NixlConnector", cpu=False, host="10.0.0.5", rdma_devices="mlx5_0:1")
    pre, dec = t["prefill"], t["decode"]
    cfg = json.loads(pre.argv("0.32.0")[1])
    assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                   "kv_buffer_device": "cuda"}
    assert pre.env()["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.5"
    assert pre.env()["VLLM_NIXL_SIDE_CHANNEL_PORT"] != dec.env()["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert dec.env()["UCX_NET_DEVICES"] == "mlx5_0:1" and "UCX_TLS" in dec.env()
    ex = C.pool_transfers("ExampleConnector", cpu=True, store="/tmp/kv")["decode"]
    assert json.loads(ex.argv("0.32.0")[1])["kv_connector_extra_config"] == {
        "shared_storage_path": "/tmp/kv"}
    assert ex.env() == {}  # no side channel, no RDMA
    with pytest.raises(InputError, match="needs a folder"):
        C.pool_transfers("ExampleConnector", cpu=True)
