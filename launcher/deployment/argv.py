"""The engine's argv, built in one place from its typed `EngineConfig`.

`engine_values` lists each vLLM flag's value by its vLLM dest name, in the order the argv
has always had (None or False: not passed, vLLM's default holds); `engine_argv` writes them.
The writing is the flag table's job (issue 32 point 2, `inputs/vllm_flags.argv` takes exactly
these (dest, value) pairs); `_write` is its stand-in until the table is merged here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from .plan import EngineConfig


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
        ("enable_reasoning", bool(e.reasoning_parser) and e.enable_reasoning),
        ("reasoning_parser", e.reasoning_parser),
        ("tool_call_parser", e.tool_call_parser),
        ("enable_auto_tool_choice", bool(e.tool_call_parser) and e.enable_auto_tool_choice),
        ("chat_template", e.chat_template),
        ("tokenizer_mode", e.tokenizer_mode),
    ]


def _write(values: Iterable[tuple[str, Any]]) -> list[str]:
    """(dest, value) pairs as argv: True is a bare switch, None/False are left out."""
    out: list[str] = []
    for dest, value in values:
        if value is None or value is False:
            continue
        name = "--" + dest.replace("_", "-")
        if value is True:
            out.append(name)
        elif isinstance(value, float):
            out += [name, f"{value:.2f}"]  # gpu_memory_utilization, as vLLM logs it
        elif isinstance(value, dict):
            out += [name, json.dumps(value, separators=(",", ":"))]
        else:
            out += [name, str(value)]
    return out


def engine_argv(e: EngineConfig) -> list[str]:
    """vLLM's arguments for engine `e` (after `vllm serve`)."""
    return _write(engine_values(e))
