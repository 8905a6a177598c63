"""The engine's argv, built in one place from its typed `EngineConfig`.

The flag table (issue 32, point 2) will own the flag strings; until it lands, this is the one
function that spells them, in the order vLLM's `--help` groups them.
"""

from __future__ import annotations

import json

from .plan import EngineConfig


def engine_argv(e: EngineConfig) -> list[str]:
    """vLLM's arguments for engine `e` (after `vllm serve`)."""
    args = ["--model", e.model]
    if e.served_model_name:
        args += ["--served-model-name", e.served_model_name]
    elif e.revision:  # the Hub revision as the user gave it, like the id
        args += ["--revision", e.revision]
    p = e.parallel
    args += ["--tensor-parallel-size", str(p.tp)]
    if p.pp > 1:
        args += ["--pipeline-parallel-size", str(p.pp)]
    if p.dp > 1:
        args += ["--data-parallel-size", str(p.dp)]
    if p.expert_parallel:
        args.append("--enable-expert-parallel")
    args += ["--max-model-len", str(e.max_model_len), "--kv-cache-dtype", e.kv_cache_dtype]
    if e.kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes)]
    if not (e.kv_cache_memory_bytes is not None and e.platform == "cpu"):
        # With a pinned KV size vLLM skips profiling but still checks free memory against
        # utilization x total (v1/worker/gpu_worker.py Worker.init_device ->
        # v1/worker/utils.py request_memory): keep the utilization the plan chose.
        args += ["--gpu-memory-utilization", f"{e.gpu_memory_utilization:.2f}"]
    args += ["--max-num-seqs", str(e.max_num_seqs),
             "--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    if e.enable_chunked_prefill:
        args.append("--enable-chunked-prefill")
    if e.enforce_eager and e.platform != "cpu":
        args.append("--enforce-eager")
    if e.speculative_config is not None:
        s = e.speculative_config
        args += ["--speculative-config", json.dumps(
            {"method": s.method, "num_speculative_tokens": s.num_speculative_tokens},
            separators=(",", ":"))]
    if e.all2all_backend:
        args += ["--all2all-backend", e.all2all_backend]
    if e.reasoning_parser:
        if e.enable_reasoning:
            args.append("--enable-reasoning")
        args += ["--reasoning-parser", e.reasoning_parser]
    if e.tool_call_parser:
        args += ["--tool-call-parser", e.tool_call_parser]
        if e.enable_auto_tool_choice:
            args.append("--enable-auto-tool-choice")
    if e.chat_template:
        args += ["--chat-template", e.chat_template]
    if e.tokenizer_mode:
        args += ["--tokenizer-mode", e.tokenizer_mode]
    return args
