"""The engine's argv, built in one place from its typed `EngineConfig`.

`engine_values` lists each vLLM flag's value by its vLLM dest name, in the order the argv
has always had (None or False: not passed, vLLM's default holds); `engine_argv` writes them.
The writing is the flag table's job (`inputs/vllm_flags.argv` takes exactly these (dest, value)
pairs): no flag is spelt here.
"""

from __future__ import annotations

import json
from typing import Any

from ..inputs import vllm_flags
from .plan import EngineConfig, Pool


def engine_values(e: EngineConfig) -> list[tuple[str, Any]]:
    """Every flag the plan sets for engine `e`, as (vLLM dest, value)."""
    p, cpu = e.parallel, e.platform == "cpu"
    pinned_kv = e.kv_cache_memory_bytes is not None
    s = e.speculative_config
    return [
        ("model", e.model),
        ("served_model_name", e.served_model_name),
        # the Hub revision as the user gave it, like the id (a local model has none)
        ("revision", None if e.served_model_name else e.revision),
        ("tensor_parallel_size", p.tp),
        ("pipeline_parallel_size", p.pp if p.pp > 1 else None),
        ("data_parallel_size", p.dp if p.dp > 1 else None),
        ("enable_expert_parallel", p.expert_parallel),
        ("max_model_len", e.max_model_len),
        ("kv_cache_dtype", e.kv_cache_dtype),
        ("kv_cache_memory_bytes", e.kv_cache_memory_bytes),
        # With a pinned KV size vLLM skips profiling but still checks free memory against
        # utilization x total (v1/worker/gpu_worker.py Worker.init_device ->
        # v1/worker/utils.py request_memory): keep the utilization the plan chose.
        ("gpu_memory_utilization", None if pinned_kv and cpu else e.gpu_memory_utilization),
        ("max_num_seqs", e.max_num_seqs),
        ("max_num_batched_tokens", e.max_num_batched_tokens),
        ("enable_chunked_prefill", e.enable_chunked_prefill),
        ("enforce_eager", e.enforce_eager and not cpu),  # the CPU engine is always eager
        ("speculative_config", {"method": s.method,
                                "num_speculative_tokens": s.num_speculative_tokens}
         if s else None),
        ("all2all_backend", e.all2all_backend),
        ("enable_eplb", e.enable_eplb),
        ("eplb_config", {"num_redundant_experts": e.num_redundant_experts}
         if e.enable_eplb and e.num_redundant_experts else None),
        ("enable_reasoning", bool(e.reasoning_parser) and e.enable_reasoning),
        ("reasoning_parser", e.reasoning_parser),
        ("tool_call_parser", e.tool_call_parser),
        ("enable_auto_tool_choice", bool(e.tool_call_parser) and e.enable_auto_tool_choice),
        ("chat_template", e.chat_template),
        ("tokenizer_mode", e.tokenizer_mode),
    ]


def engine_argv(e: EngineConfig) -> list[str]:
    """vLLM's arguments for engine `e` (after `vllm serve`)."""
    return vllm_flags.argv(engine_values(e))


def pool_argv(pool: Pool) -> list[str]:
    """vLLM's arguments for one engine of `pool`: its engine's, then its side of the KV
    hand-off (a prefill or decode pool)."""
    out = engine_argv(pool.engine)
    if pool.transfer is not None:  # vllm/engine/arg_utils.py EngineArgs.kv_transfer_config
        out += vllm_flags.argv([("kv_transfer_config", json.dumps(
            dict(pool.transfer.config), sort_keys=True, separators=(",", ":")))])
    return out
