"""KV connectors for prefill/decode pools: which vLLM has each, what layouts each accepts, and
each pool's `--kv-transfer-config` and environment.

The facts are data (`profiles/connectors.yaml`, schema-checked, sourced from each release's
sdist and the connectors' documentation); this module applies them. A refusal is an
`InputError` (one line, exit 2 at the CLI) naming the rule and what to do instead.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from ...errors import InputError
from ...inputs import vllm_flags
from ...paths import profiles_dir, read_yaml
from .capabilities import parse_version

ROLES = ("prefill", "decode")
NIXL_SIDE_CHANNEL_PORT = 5600
"""vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT (vllm/envs.py); each DP engine listens on base + its
DP rank (`side_channel_ports`; nixl_connector_usage.md says the local rank, 0.32's code the global
one)."""
RDMA_UCX_TLS = "rc,cuda_copy,cuda_ipc"
"""UCX transports for GPU memory over InfiniBand/RoCE between nodes: reliable connection plus
CUDA copy and IPC (llm-d's wide-EP manifests and nixl_connector_usage.md set UCX_TLS so)."""


@functools.lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    return read_yaml(profiles_dir() / "connectors.yaml")


def _has(row: dict[str, Any], version: str) -> bool:
    v = parse_version(version)
    if v < parse_version(str(row["since"])):
        return False
    return "until" not in row or v <= parse_version(str(row["until"]))


def connectors_in(version: str) -> list[str]:
    """The connectors `version` registers, as the table knows them."""
    return [name for name, row in table()["connectors"].items() if _has(row, version)]


def check(connector: str, version: str, prefill_tp: int, decode_tp: int, mla: bool) -> None:
    """Refuse a connector the version lacks, or a TP pairing the connector cannot move."""
    rows = table()["connectors"]
    if connector not in rows:
        raise InputError(f"unknown KV connector '{connector}'; choose one of "
                         f"{', '.join(rows)}")
    row = rows[connector]
    if not _has(row, version):
        span = (f"{row['since']} to {row['until']}" if "until" in row
                else f"{row['since']} and later")
        have = ", ".join(connectors_in(version)) or "none of these"
        raise InputError(f"vLLM {version} has no {connector} (it is in {span}); with "
                         f"{version} use {have}, or pin another --vllm-version")
    rule = "any" if (mla and row["mla_any_tp"]) else row["tp_rule"]
    if rule == "equal" and prefill_tp != decode_tp:
        raise InputError(f"{connector} needs the same tensor-parallel size on both pools "
                         f"(prefill TP{prefill_tp}, decode TP{decode_tp}); pin equal sizes or "
                         f"use NixlConnector")
    if rule == "decode_at_least_prefill" and decode_tp < prefill_tp:
        raise InputError(f"{connector} moves a non-MLA model's KV only to a decode TP at least "
                         f"the prefill TP (prefill TP{prefill_tp}, decode TP{decode_tp}); give "
                         f"decode TP >= {prefill_tp}")


def field_allowed(name: str, version: str) -> bool:
    row = table()["fields"].get(name)
    return row is not None and _has(row, version)


@dataclass(frozen=True)
class Transfer:
    """One pool's side of the KV hand-off: what its engine is told, and how to reach it."""

    connector: str
    role: str  # prefill | decode
    buffer_device: str  # cuda | cpu
    extra: tuple[tuple[str, Any], ...] = ()
    side_channel_host: str | None = None
    side_channel_port: int | None = None
    rdma_devices: str | None = None  # UCX_NET_DEVICES, e.g. mlx5_0:1, where pools span nodes

    def config(self, version: str) -> dict[str, Any]:
        """The `--kv-transfer-config` object. Both pools run kv_both, as vLLM's NIXL and
        example P/D set-ups do: the role a request plays comes from its kv_transfer_params."""
        out: dict[str, Any] = {"kv_connector": self.connector, "kv_role": "kv_both"}
        if field_allowed("kv_buffer_device", version):
            out["kv_buffer_device"] = self.buffer_device
        if self.extra and field_allowed("kv_connector_extra_config", version):
            out["kv_connector_extra_config"] = dict(self.extra)
        return out

    def argv(self, version: str) -> list[str]:
        return vllm_flags.argv([("kv_transfer_config", json.dumps(
            self.config(version), sort_keys=True, separators=(",", ":")))])

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        if self.side_channel_host:  # "": the pod's own address, set where it runs
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.side_channel_host
        if self.side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        if self.rdma_devices:
            env["UCX_TLS"] = RDMA_UCX_TLS
            env["UCX_NET_DEVICES"] = self.rdma_devices
        return env


def side_channel_ports(pool: Any) -> tuple[int, int]:
    """The first and last NIXL side-channel port the engines of one replica of `pool` listen on:
    its VLLM_NIXL_SIDE_CHANNEL_PORT plus each engine's DP rank. The rank is the global one, also
    on a replica over several nodes: vLLM 0.32's nixl/base_scheduler.py sets side_channel_port =
    VLLM_NIXL_SIDE_CHANNEL_PORT + parallel_config.data_parallel_index, and config/parallel.py
    sets data_parallel_index = data_parallel_rank."""
    base = int(pool.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    return base, base + max(1, pool.engine.parallel.dp) - 1


def pool_transfers(connector: str, *, cpu: bool, store: str | None = None,
                   host: str = "127.0.0.1", rdma_devices: str | None = None
                   ) -> dict[str, Transfer]:
    """Both pools' sides for one connector. `store` is ExampleConnector's shared folder."""
    row = table()["connectors"][connector]
    extra: tuple[tuple[str, Any], ...] = ()
    if row.get("shared_storage"):
        if not store:
            raise InputError(f"{connector} needs a folder both engines share (its store)")
        extra = (("shared_storage_path", store),)
    device = "cpu" if cpu else "cuda"
    out = {}
    for i, role in enumerate(ROLES):
        nixl = row["handshake"]
        out[role] = Transfer(connector, role, device, extra,
                             side_channel_host=host if nixl else None,
                             # two engines on one host must not share the side-channel port
                             side_channel_port=NIXL_SIDE_CHANNEL_PORT + 8 * i if nixl else None,
                             rdma_devices=rdma_devices)
    return out
