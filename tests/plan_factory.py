"""Small typed plans for tests of what runs a plan (multinode, exec's checks): a Deployment of one
aggregated pool whose engine holds exactly the layout and flags a test names, everything else
plain. The planner makes real ones (tests that need its figures call make_plan); these exist so
a test can state a layout, a tampered value or an old vLLM release without planning."""

from __future__ import annotations

import dataclasses
from typing import Any

from launcher.deployment import plan as P

MODEL = "deepseek-ai/DeepSeek-R1"


def deployment(tp: int = 8, pp: int = 1, dp: int = 1, ep: bool = False, nodes: int = 1,
               gpus_per_node: int = 8, backend: str = "mp", env: dict[str, str] | None = None,
               model: str = MODEL, model_path: str | None = None, vllm_version: str = "0.32.0",
               gpu: str = "H100", **engine: Any) -> P.Deployment:
    """One aggregated pool of `tp x pp x dp` ranks over `nodes` nodes; `engine` overrides any
    EngineConfig field (max_model_len, chat_template, kv_cache_dtype ...)."""
    parallel = P.Parallel(tp=tp, pp=pp, dp=dp, expert_parallel=ep, nodes=nodes)
    fields = dict(model=model_path or model, parallel=parallel, max_model_len=32768,
                  kv_cache_dtype="auto", gpu_memory_utilization=0.9, max_num_seqs=256,
                  max_num_batched_tokens=8192, platform="cuda",
                  distributed_executor_backend=backend)
    fields.update(engine)
    e = P.EngineConfig(**fields)
    kv = P.KVCache(dtype="auto", bytes_per_token=70272, block_size=64, memory_bytes=1 << 34,
                   tokens=200_000, blocks=3125, pinned=False)
    budget = P.PerGpuBudget(requested_bytes=1 << 36, weights_bytes=1 << 35,
                            activation_bytes=1 << 30, cudagraph_bytes=1 << 29,
                            non_torch_bytes=1 << 29, kv_cache_bytes=1 << 34)
    gpus = tp * pp * dp
    pool = P.Pool(role="aggregated", replicas=1, gpus_per_replica=gpus, nodes_per_replica=nodes,
                  engine=e, env=dict(env if env is not None
                                     else {"VLLM_ENGINE_READY_TIMEOUT_S": "1800"}),
                  kv_cache=kv, per_gpu=budget, max_concurrency=6.1, performance=None,
                  serving=None)
    ref = P.ModelRef(name="deepseek-r1", hf_id=model, architecture="DeepseekV3ForCausalLM",
                     params=671_000_000_000, weights_bytes=673_000_000_000, quantization="fp8",
                     path=model_path, max_context=163840, attention="mla", source="test",
                     estimate="test")
    hw = P.HardwareRef(name=gpu, nodes=nodes, gpus_per_node=gpus_per_node,
                       total_bytes=80 << 30, free_bytes=79 << 30, source="test",
                       compute_capability="9.0", platform="cuda")
    return P.Deployment(fits=True, model=ref, hardware=hw, vllm_version=vllm_version,
                        objective="balanced", workload=None, slo=None, kind="aggregated",
                        pools=(pool,), performance=None, candidates=P.SearchCounts(1, 1))


def with_engine(d: P.Deployment, **engine: Any) -> P.Deployment:
    """`d` with its one pool's engine fields replaced."""
    pool = dataclasses.replace(d.pool, engine=dataclasses.replace(d.pool.engine, **engine))
    return dataclasses.replace(d, pools=(pool,))


def with_env(d: P.Deployment, env: dict[str, Any]) -> P.Deployment:
    """`d` with its one pool's environment replaced."""
    return dataclasses.replace(d, pools=(dataclasses.replace(d.pool, env=env),))
