"""build_launch: which of vLLM's own multi-node mechanisms each plan gets, per node."""

from __future__ import annotations

import pytest
from plan_factory import deployment, with_engine

from launcher.deployment.argv import pool_argv
from launcher.deployment.codec import dump, load
from launcher.errors import InputError
from launcher.run.multinode import LEADER, WORKER, LwsEnv, build_launch

LEADER_DNS = "vlaunch-0.vlaunch.default"


def _plan(tp=8, pp=1, dp=1, ep=False, nodes=1, gpus_per_node=8, backend="mp"):
    return deployment(tp=tp, pp=pp, dp=dp, ep=ep, nodes=nodes, gpus_per_node=gpus_per_node,
                      backend=backend)


def _args(plan):
    """The plan's vLLM arguments, as its pool gives them (`vllm serve` then takes the model as
    its positional)."""
    return pool_argv(plan.pool)


def _lws(index, size=2, leader=LEADER_DNS, **more):
    env = {
        "LWS_LEADER_ADDRESS": leader,
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(index),
    }
    env.update(more)
    return env


def _after(argv, flag):
    return argv[argv.index(flag) + 1]


def test_single_node_runs_the_plan_unchanged():
    plan = _plan()
    launch = build_launch(plan, environ={})
    # `vllm serve MODEL`: the model positional (the plan's args start with --model MODEL)
    assert _args(plan)[0] == "--model"
    assert launch.argv == ["vllm", "serve", *_args(plan)[1:]]
    assert (launch.role, launch.node_rank, launch.nnodes) == (LEADER, 0, 1)
    assert launch.env == plan.pool.env and launch.pre_commands == [] and launch.serves_api


def test_single_node_refuses_a_worker():
    with pytest.raises(InputError, match="one node"):
        build_launch(_plan(), environ={}, role=WORKER)


def test_program_is_configurable():
    launch = build_launch(_plan(), environ={}, program=["python3", "-m", "x", "serve"])
    assert launch.argv[:4] == ["python3", "-m", "x", "serve"]


def test_mp_tp_pp_across_two_nodes_leader_and_worker():
    plan = _plan(tp=8, pp=2, nodes=2)
    lead = build_launch(plan, environ=_lws(0, POD_IP="10.0.0.5"))
    work = build_launch(plan, environ=_lws(1, POD_IP="10.0.0.6"))
    for launch, rank in ((lead, 0), (work, 1)):
        serve = ["vllm", "serve", *_args(plan)[1:]]  # the model positional
        assert launch.argv[: len(serve)] == serve
        assert _after(launch.argv, "--nnodes") == "2"
        assert _after(launch.argv, "--node-rank") == str(rank)
        assert _after(launch.argv, "--master-addr") == LEADER_DNS
        assert "--master-port" not in launch.argv  # vLLM's default unless asked
        assert "--data-parallel-address" not in launch.argv
        assert launch.pre_commands == []
    assert "--headless" not in lead.argv and lead.serves_api and lead.role == LEADER
    assert "--headless" in work.argv and not work.serves_api and work.role == WORKER
    assert lead.env["VLLM_HOST_IP"] == "10.0.0.5" and work.env["VLLM_HOST_IP"] == "10.0.0.6"
    assert lead.env["VLLM_ENGINE_READY_TIMEOUT_S"] == "1800"


def test_mp_master_port_when_given():
    launch = build_launch(_plan(tp=16, nodes=2), environ=_lws(0), master_port=29600)
    assert _after(launch.argv, "--master-port") == "29600"


def test_mp_dp_ep_across_nodes():
    plan = _plan(tp=1, dp=16, ep=True, nodes=2)
    lead = build_launch(plan, environ=_lws(0))
    work = build_launch(plan, environ=_lws(1))
    for launch in (lead, work):
        assert _after(launch.argv, "--data-parallel-size") == "16"
        assert _after(launch.argv, "--data-parallel-size-local") == "8"
        assert _after(launch.argv, "--data-parallel-address") == LEADER_DNS
        assert _after(launch.argv, "--data-parallel-rpc-port") == "29550"
        assert "--enable-expert-parallel" in launch.argv
        assert "--nnodes" not in launch.argv
    assert "--data-parallel-start-rank" not in lead.argv and "--headless" not in lead.argv
    assert _after(work.argv, "--data-parallel-start-rank") == "8"
    assert "--headless" in work.argv and not work.serves_api


def test_dp_start_rank_of_third_node():
    plan = _plan(tp=2, dp=12, ep=True, nodes=3, gpus_per_node=8)
    work = build_launch(plan, environ=_lws(2, size=3), dp_rpc_port=31000)
    assert _after(work.argv, "--data-parallel-size-local") == "4"
    assert _after(work.argv, "--data-parallel-start-rank") == "8"
    assert _after(work.argv, "--data-parallel-rpc-port") == "31000"


def test_ray_leader_starts_head_then_vllm_and_worker_joins():
    plan = _plan(tp=8, pp=2, nodes=2, backend="ray")
    lead = build_launch(plan, environ=_lws(0))
    work = build_launch(plan, environ=_lws(1))
    assert lead.pre_commands == [["ray", "start", "--head", "--port=6379"]]
    assert lead.argv == [
        "vllm",
        "serve",
        *_args(plan)[1:],
        "--distributed-executor-backend",
        "ray",
    ]
    assert work.argv == ["ray", "start", f"--address={LEADER_DNS}:6379", "--block"]
    assert work.pre_commands == [] and not work.serves_api


def test_ray_data_parallel_is_refused():
    with pytest.raises(InputError, match="mp backend"):
        build_launch(_plan(tp=1, dp=16, ep=True, nodes=2, backend="ray"), environ=_lws(0))


def test_role_from_flag_without_lws_index_on_two_nodes():
    plan = _plan(tp=16, nodes=2)
    env = {"LWS_LEADER_ADDRESS": LEADER_DNS}
    assert build_launch(plan, environ=env, role=LEADER).node_rank == 0
    assert build_launch(plan, environ=env, role=WORKER).node_rank == 1


def test_loopback_leader_address_override():
    launch = build_launch(
        _plan(tp=16, nodes=2), environ={}, role=LEADER, leader_address="127.0.0.1"
    )
    assert _after(launch.argv, "--master-addr") == "127.0.0.1"


@pytest.mark.parametrize(
    "plan, environ, role, match",
    [
        (_plan(tp=16, nodes=2), _lws(1), LEADER, "makes this node the worker"),
        (_plan(tp=16, nodes=2), _lws(0, size=3), None, "LWS_GROUP_SIZE=3"),
        (_plan(tp=16, nodes=2), _lws(2), None, "expected 0..1"),
        (_plan(tp=16, nodes=2), {"LWS_WORKER_INDEX": "0"}, None, "LWS_LEADER_ADDRESS"),
        (_plan(tp=24, nodes=3, gpus_per_node=8), {"LWS_LEADER_ADDRESS": "x"}, WORKER, "rank"),
        (_plan(tp=16, nodes=2), _lws("one"), None, "whole number"),
        (_plan(tp=16, nodes=2), _lws(0), "boss", "leader or worker"),
        (_plan(tp=6, nodes=4, gpus_per_node=2), _lws(0, size=4), None, "evenly"),
        (_plan(tp=1, dp=3, ep=True, nodes=2), _lws(0), None, "evenly"),
        (_plan(tp=8, nodes=2, gpus_per_node=8), _lws(0), None, "4 GPU ranks"),
        (_plan(tp=16, nodes=2, backend="slurm"), _lws(0), None, "mp or ray"),
    ],
)
def test_errors_say_what_to_fix(plan, environ, role, match):
    with pytest.raises(InputError, match=match):
        build_launch(plan, environ=environ, role=role)


def test_plan_that_contradicts_itself_is_refused():
    # A typed plan has one layout (its engine's); a plan.json whose summary or argv says
    # otherwise than its pool is refused when it is read, before any node runs it.
    raw = dump(_plan(tp=16, nodes=2))
    raw["parallel"]["tp"] = 8
    raw["parallel"]["pp"] = 2
    with pytest.raises(InputError, match="`parallel` differs"):
        load(raw)
    raw = dump(_plan(tp=1, dp=16, ep=True, nodes=2))
    raw["pools"][0]["vllm_args"].remove("--enable-expert-parallel")
    with pytest.raises(InputError, match="vllm_args` differ"):
        load(raw)


@pytest.mark.parametrize("flag", ["--nnodes=2", "--headless", "--data-parallel-address"])
def test_plan_must_not_carry_per_node_flags(flag):
    # the engine writes no per-node flag, so one in plan.json is an edit the codec refuses ...
    raw = dump(_plan(tp=16, nodes=2))
    raw["pools"][0]["vllm_args"].append(flag)
    raw["vllm_args"].append(flag)
    with pytest.raises(InputError, match="vllm_args` differ"):
        load(raw)


def test_an_engine_that_names_its_own_node_flags_is_refused(monkeypatch):
    # ... and build_launch refuses one if a pool's argv ever held one (defence in depth)
    import launcher.run.multinode as mn

    plan = _plan(tp=16, nodes=2)
    monkeypatch.setattr(mn, "pool_argv", lambda pool: [*pool_argv(pool), "--headless"])
    with pytest.raises(InputError, match="per-node flags"):
        build_launch(plan, environ=_lws(0))


def test_the_layout_comes_from_the_engine_not_the_argv_text():
    plan = with_engine(_plan(tp=1, nodes=2), parallel=_plan(tp=16, nodes=2).engine.parallel)
    assert "--nnodes" in build_launch(plan, environ=_lws(0)).argv


def test_lws_env_parsing():
    env = LwsEnv.from_environ(_lws(1, size=4))
    assert env == LwsEnv(leader_address=LEADER_DNS, group_size=4, worker_index=1)
    assert LwsEnv.from_environ({}) == LwsEnv()


def test_real_plan_two_nodes_leader_and_worker():
    # A plan straight from the planner (DeepSeek-R1 on 2x8xH100) becomes two node commands.
    from launcher.inputs.hardware import parse_gpus
    from launcher.inputs.model import load_model
    from launcher.predict.search.planner import Pins, make_plan

    d = make_plan(load_model("deepseek-r1"), parse_gpus("2x8xH100"),
                  Pins(vllm_version="0.32.0")).deployment()
    env = {"LWS_LEADER_ADDRESS": "10.0.0.1", "LWS_GROUP_SIZE": "2"}
    leader = build_launch(d, {**env, "LWS_WORKER_INDEX": "0"})
    worker = build_launch(d, {**env, "LWS_WORKER_INDEX": "1"})
    assert leader.role == "leader" and worker.role == "worker"
    assert "--headless" in worker.argv and "--headless" not in leader.argv
    assert leader.serves_api and not worker.serves_api


def test_the_pool_it_runs_can_be_named():
    # a disaggregated plan: a one-node TP8 prefill pool and a two-node DP16 + EP decode pool
    import dataclasses

    pre = dataclasses.replace(_plan(tp=8).pool, role="prefill")
    dec = dataclasses.replace(_plan(tp=1, dp=16, ep=True, nodes=2).pool, role="decode")
    d = dataclasses.replace(_plan(tp=1, dp=16, ep=True, nodes=2), kind="disaggregated",
                            pools=(pre, dec))
    work = build_launch(d, environ=_lws(1), pool=dec)
    assert _after(work.argv, "--data-parallel-size-local") == "8"
    assert _after(work.argv, "--data-parallel-start-rank") == "8" and "--headless" in work.argv
    one = build_launch(d, environ={}, pool=pre)
    assert one.nnodes == 1 and "--data-parallel-address" not in one.argv
    assert one.argv == ["vllm", "serve", *pool_argv(pre)[1:]]
