"""One pool of a disaggregated plan per folder: `vlaunch plan ... --role prefill|decode --emit
DIR` writes the whole deployment naming the pool it runs, and `vlaunch exec --plan DIR` starts
that pool's engine (launcher/run/emit.py pool_plan, launcher/run/exec_plan.py check_pool_plan)."""

from __future__ import annotations

import dataclasses
import functools
import json
import shlex

import pytest
import yaml
from click.testing import CliRunner
from schema_check import schema_errors

from launcher.cli import cli
from launcher.deployment.argv import pool_argv
from launcher.deployment.codec import dump, load
from launcher.errors import InputError
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.workload import SLO, Workload
from launcher.predict.search import pd_pools
from launcher.predict.search.planner import Pins
from launcher.run import emit

VERSION = "0.32.0"
RELAXED = SLO(ttft_ms=10_000, tpot_ms=50)
CASES = [("llama-3.1-8b", "8xH100"), ("llama-3.1-8b", "2x8xH200"), ("deepseek-r1", "2x8xH200"),
         ("deepseek-v2-lite", "8xH100"), ("llama-3.1-70b", "8xH200")]
ROLES = ("prefill", "decode")


@functools.cache
def _split(model: str, gpus: str):
    return pd_pools.plan_deployment(load_model(model), parse_gpus(gpus),
                                    Pins(vllm_version=VERSION), mode="on",
                                    workload=Workload(8192, 512), slo=RELAXED).deployment


@pytest.mark.parametrize("model,gpus", CASES)
@pytest.mark.parametrize("role", ROLES)
def test_a_pools_plan_round_trips_and_its_summary_keys_are_that_pools(model, gpus, role):
    whole = _split(model, gpus)
    d = emit.pool_plan(whole, role)
    pool = next(p for p in whole.pools if p.role == role)
    # the whole deployment; only a one-node split's loopback side-channel host is left to
    # where each engine runs (a pool's folder runs apart from the other pool)
    def apart(p):
        return dataclasses.replace(p, env={k: v for k, v in p.env.items()
                                           if k != "VLLM_NIXL_SIDE_CHANNEL_HOST"})

    assert d.pools == tuple(map(apart, whole.pools)) and d.role == role
    assert d.pool == apart(pool) and d.engine == pool.engine
    assert all("VLLM_NIXL_SIDE_CHANNEL_HOST" not in p.env for p in d.pools)
    j = json.loads(json.dumps(dump(d)))
    assert load(j) == d and schema_errors("plan", j) == []
    assert j["role"] == role and "role" not in dump(whole)  # only a pool's folder names one
    i = [p.role for p in d.pools].index(role)
    for key in ("kv_cache", "per_gpu", "env", "vllm_args", "autoscaling", "startup"):
        assert j[key] == j["pools"][i][key], key
    assert j["max_num_seqs"] == pool.engine.max_num_seqs
    # the summary-key check holds for the new field: an edit of the pool's argv alone is caught
    other = j["pools"][1 - i]["vllm_args"]
    if other != j["vllm_args"]:
        with pytest.raises(InputError, match="`vllm_args` differs"):
            load({**j, "vllm_args": other})
    with pytest.raises(InputError, match="`role` is 'aggregated'; it must be one of"):
        load({**j, "role": "aggregated"})


def test_a_role_names_a_pool_of_a_split_plan_only():
    agg = dataclasses.replace(_split("llama-3.1-8b", "8xH100"), kind="aggregated")
    with pytest.raises(InputError, match="the plan is aggregated"):
        emit.pool_plan(agg, "decode")
    with pytest.raises(InputError, match="one of prefill, decode"):
        emit.pool_plan(_split("llama-3.1-8b", "8xH100"), "aggregated")
    j = dump(emit.pool_plan(_split("llama-3.1-8b", "8xH100"), "decode"))
    with pytest.raises(InputError, match="has no aggregated pool|is 'decode' but"):
        load({**j, "deployment": "aggregated"})


@pytest.mark.parametrize("model,gpus", CASES)
def test_each_folder_holds_its_pools_files(model, gpus, tmp_path):
    whole = _split(model, gpus)
    for role in ROLES:
        d = emit.pool_plan(whole, role)
        out = tmp_path / role
        paths = emit.emit_plan(d, out)
        assert [p.name for p in paths][-1] == "plan.json"
        pool = d.pool
        args = (out / "vllm-args").read_text().splitlines()
        assert args == pool_argv(pool)
        kv = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert kv == dict(pool.transfer.config)
        assert kv["kv_connector"] == "NixlConnector" and kv["kv_buffer_device"] == "cuda"
        assert kv["kv_role"] == "kv_both"
        env = dict(line.split("=", 1) for line in (out / "vllm.env").read_text().splitlines())
        env = {k: shlex.split(v)[0] for k, v in env.items()}
        assert env == dict(pool.env)
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) >= 5600
        rdma = pool.transfer.path == "rdma"
        assert ("UCX_TLS" in env) == ("UCX_NET_DEVICES" in env) == rdma
        # the engine's own address is set where it runs, even for a one-node split (whose
        # whole plan says loopback: both engines under one `vlaunch serve`)
        assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in env
        assert (whole.pool.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") == "127.0.0.1") == (not rdma)
        objs = list(yaml.safe_load_all((out / "scaledobject.yaml").read_text()))
        assert [o["metadata"]["name"] for o in objs] == [f"vlaunch-{role}"]
        assert objs[0]["spec"]["scaleTargetRef"]["name"] == f"vlaunch-{role}"
        assert objs[0]["spec"]["minReplicaCount"] == pool.autoscaling.min_replicas
        assert emit.load_plan(out) == d
    a = json.loads((tmp_path / "prefill" / "plan.json").read_text())
    b = json.loads((tmp_path / "decode" / "plan.json").read_text())
    assert a["pools"] == b["pools"] and a["performance"] == b["performance"]


def test_a_whole_split_plan_is_not_emitted_into_one_folder(tmp_path):
    with pytest.raises(InputError, match="--role prefill or --role decode"):
        emit.emit_plan(_split("llama-3.1-8b", "8xH100"), tmp_path)
    assert not any(tmp_path.iterdir())


def _cli(*args: str, env: dict | None = None):
    return CliRunner().invoke(cli, list(args), env=env)


def _one_line(r, says: str) -> None:
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and says in lines[0], r.output


def test_the_cli_emits_the_same_plan_in_every_pod(tmp_path):
    """Two pods of either pool plan independently and must agree: the plan is deterministic."""
    base = ["plan", "llama-3.1-8b", "--gpus", "8xH100", "--vllm-version", VERSION,
            "--disaggregate", "on", "--input-len", "8192"]
    for pod, role in enumerate(("prefill", "decode", "decode")):
        r = _cli(*base, "--role", role, "--emit", str(tmp_path / f"pod{pod}"), "--format", "json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["role"] == role
    texts = [json.loads((tmp_path / f"pod{i}" / "plan.json").read_text()) for i in range(3)]
    assert texts[1] == texts[2]
    assert {k: v for k, v in texts[0].items() if k == "pools"} == \
        {k: v for k, v in texts[1].items() if k == "pools"}
    r = _cli(*base, "--role", "decode", "--format", "args")
    assert r.exit_code == 0 and r.output.split() == texts[1]["vllm_args"]


@pytest.mark.parametrize("args,says", [
    (["--gpus", "8xH100", "--disaggregate", "off", "--role", "decode"], "--disaggregate off"),
    (["--gpus", "8xH100", "--input-len", "200", "--output-len", "200", "--role", "prefill"],
     "the plan is aggregated"),
    (["--gpus", "1xH100", "--role", "prefill", "--emit", "DIR"], "the plan is aggregated"),
    (["--gpus", "1xH100", "--disaggregate", "on", "--role", "prefill"], "needs at least 2 GPUs"),
])
def test_role_without_a_split_plan_is_one_line(args, says, tmp_path):
    args = [str(tmp_path / "out") if a == "DIR" else a for a in args]
    _one_line(_cli("plan", "llama-3.1-8b", "--vllm-version", VERSION, *args), says)
    assert not (tmp_path / "out").exists()


def _emitted(tmp_path, gpus: str, role: str) -> str:
    out = tmp_path / role
    r = _cli("plan", "llama-3.1-8b", "--gpus", gpus, "--vllm-version", VERSION,
             "--disaggregate", "on", "--input-len", "8192", "--role", role, "--emit", str(out))
    assert r.exit_code == 0, r.output
    return str(out)


@pytest.mark.parametrize("role", ROLES)
def test_exec_starts_the_pool_its_folder_names(role, tmp_path):
    folder = _emitted(tmp_path, "8xH100", role)
    d = emit.load_plan(folder)
    _one_line(_cli("exec", "--plan", folder, "--dry-run", "--no-metrics",
                   env={"VLLM_NIXL_SIDE_CHANNEL_HOST": ""}), "VLLM_NIXL_SIDE_CHANNEL_HOST")
    r = _cli("exec", "--plan", folder, "--dry-run", "--no-metrics",
             env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3"})
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split()).replace(" \\ ", " ")
    assert f"--max-num-seqs {d.pool.engine.max_num_seqs}" in flat
    assert "--kv-transfer-config" in flat and "NixlConnector" in flat
    assert f"VLLM_NIXL_SIDE_CHANNEL_PORT={d.pool.env['VLLM_NIXL_SIDE_CHANNEL_PORT']}" in flat


def test_exec_of_a_pool_over_nodes_needs_its_own_address(tmp_path):
    folder = _emitted(tmp_path, "2x8xH200", "decode")
    assert emit.load_plan(folder).pool.transfer.path == "rdma"
    _one_line(_cli("exec", "--plan", folder, "--dry-run", "--no-metrics",
                   env={"VLLM_NIXL_SIDE_CHANNEL_HOST": ""}), "VLLM_NIXL_SIDE_CHANNEL_HOST")
    r = _cli("exec", "--plan", folder, "--dry-run", "--no-metrics",
             env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3"})
    assert r.exit_code == 0, r.output
    _one_line(_cli("exec", "--plan", folder, "--replan", "--dry-run", "--no-metrics",
                   env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3"}), "not re-planned alone")


@pytest.mark.parametrize("name,value", [("VLLM_NIXL_SIDE_CHANNEL_PORT", "70000"),
                                        ("UCX_TLS", "rc;rm -rf /"),
                                        ("VLLM_NIXL_SIDE_CHANNEL_HOST", "-x")])
def test_a_tampered_pool_environment_is_refused(name, value, tmp_path):
    folder = _emitted(tmp_path, "2x8xH200", "prefill")
    j = json.loads((tmp_path / "prefill" / "plan.json").read_text())
    for p in j["pools"]:
        p["env"][name] = value
    j["env"][name] = value
    (tmp_path / "prefill" / "plan.json").write_text(json.dumps(j))
    _one_line(_cli("exec", "--plan", folder, "--dry-run", "--no-metrics",
                   env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3"}), name)


# ---- --kv-transfer-config in the flag table ----------------------------------------------------


@pytest.mark.parametrize("config,ok", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda"}, True),
    ({"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
      "kv_connector_extra_config": {"shared_storage_path": "/var/run/vlaunch-kv"}}, True),
    ({"kv_connector": "NixlConnector", "kv_connector_module_path": "evil.module"}, False),
    ({"kv_connector": "EvilConnector", "kv_role": "kv_both"}, False),
    ({"kv_connector": "ExampleConnector",
      "kv_connector_extra_config": {"shared_storage_path": "/etc"}}, False),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_everything"}, False),
    ({"kv_role": "kv_both"}, False),
    ({"kv_connector": {"a": 1}}, False),
    ({"kv_connector": ["NixlConnector"]}, False),
    ({"kv_connector": "NixlConnector", "kv_connector_extra_config": {
        "shared_storage_path": "/var/run/vlaunch-kv", "more": 1}}, False),
    ([], False),
    ("not json", False),
])
def test_a_plans_kv_transfer_config_is_only_what_the_planner_writes(config, ok):
    from launcher.inputs import vllm_flags as F

    why = F.check_value("kv_transfer_config",
                        config if isinstance(config, str) else json.dumps(config))
    assert (why is None) == ok, why
    assert F.available("kv_transfer_config", "0.6.5") and not F.available("kv_transfer_config",
                                                                           "0.6.4")


def test_exec_refuses_a_pool_whose_hand_off_was_rewritten(tmp_path):
    """An attacker who rewrites plan.json consistently (the codec's own dump of an edited plan)
    still cannot make exec import a module through the connector's config."""
    folder = _emitted(tmp_path, "8xH100", "decode")
    d = emit.load_plan(folder)
    evil = [dataclasses.replace(p, transfer=dataclasses.replace(p.transfer, config={
        **p.transfer.config, "kv_connector_module_path": "attacker.payload"})) for p in d.pools]
    tampered = dump(dataclasses.replace(d, pools=tuple(evil)))
    assert load(tampered).pool.transfer.config["kv_connector_module_path"]  # well formed
    (tmp_path / "decode" / "plan.json").write_text(json.dumps(tampered))
    _one_line(_cli("exec", "--plan", folder, "--dry-run", "--no-metrics",
                   env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3"}), "kv_connector_module_path")


def test_exec_of_a_pool_over_nodes_goes_through_the_multinode_launch(tmp_path):
    """4x8xH100 splits into pools of two nodes per replica: the pool's leader and worker get
    their DP ranks (run/multinode.py) and the pool's side of the hand-off."""
    out = tmp_path / "decode"
    r = _cli("plan", "deepseek-r1", "--gpus", "4x8xH100", "--vllm-version", VERSION,
             "--disaggregate", "on", "--role", "decode", "--emit", str(out))
    assert r.exit_code == 0, r.output
    d = emit.load_plan(out)
    assert d.pool.nodes_per_replica == 2 and d.engine.parallel.nodes == 2
    local = d.engine.parallel.dp // 2
    for index in (0, 1):
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": f"10.0.0.{index + 2}", "LWS_WORKER_INDEX":
               str(index), "LWS_LEADER_ADDRESS": "10.0.0.2", "LWS_GROUP_SIZE": "2"}
        r = _cli("exec", "--plan", str(out), "--dry-run", "--no-metrics", env=env)
        assert r.exit_code == 0, r.output
        flat = " ".join(r.output.split()).replace(" \\ ", " ")
        assert "--kv-transfer-config" in flat
        assert f"--max-num-seqs {d.pool.engine.max_num_seqs}" in flat
        assert f"--data-parallel-size-local {local}" in flat
        assert ("--headless" in flat) == (index == 1)
        if index:
            assert f"--data-parallel-start-rank {local}" in flat


def test_the_doctor_takes_the_pool_an_emitted_folder_names(tmp_path):
    """vlaunch runs both pools kv_both, so a log alone does not say which pool it was; the
    pool's own plan does, even where both pools' engines look alike."""
    from launcher.observe import doctor

    kv = ("KVTransferConfig(kv_connector='NixlConnector', engine_id='712be476', "
          "kv_buffer_device='cuda', kv_role='kv_both', kv_port=14579, "
          "kv_connector_extra_config={}, kv_connector_module_path=None)")
    log = tmp_path / "vllm.log"
    log.write_text(
        "INFO 11-30 10:00:00 [api_server.py:1] vLLM API server version 0.32.0\n"
        "INFO 11-30 10:00:00 [utils.py:1] non-default args: {'model': "
        f"'meta-llama/Llama-3.1-8B-Instruct', 'kv_transfer_config': {kv}}}\n"
        "(EngineCore pid=2) ERROR 11-30 10:00:09 [core.py:1010] ValueError: No available "
        "memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine.\n")
    whole = _split("llama-3.1-8b", "8xH100")
    for role in ROLES:
        d = doctor.diagnose(str(log), plan=emit.pool_plan(whole, role))[0].root
        assert d.numbers["pool"]["role"] == role
        assert "plan's role" in d.numbers["pool"]["how"]
        assert f"the {role} pool" in d.explain[0]


def test_a_pools_side_channels_are_its_base_port_plus_each_dp_rank():
    """vLLM 0.32 (nixl/base_scheduler.py): side_channel_port = VLLM_NIXL_SIDE_CHANNEL_PORT +
    data_parallel_index, the global DP rank, so a replica over two nodes uses base..base+dp-1."""
    from launcher.predict.features.connectors import side_channel_ports

    for gpus in ("2x8xH200", "4x8xH100", "8xH100"):
        for pool in pd_pools.plan_deployment(
                load_model("deepseek-r1" if "x8x" in gpus else "llama-3.1-8b"),
                parse_gpus(gpus), Pins(vllm_version=VERSION), mode="on",
                workload=Workload(8192, 512), slo=RELAXED).deployment.pools:
            base = int(pool.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
            assert side_channel_ports(pool) == (base, base + pool.engine.parallel.dp - 1)
