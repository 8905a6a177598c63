"""Re-cut a planned KV cache after a post-pass adds memory the budget model did not plan for.

The serving features decided after the layout (an MTP draft, an all-to-all backend's buffers)
each take memory from the KV cache of a candidate the budget model already sized. This module
applies vLLM's own rule once more instead of re-running the whole budget: per stage, the KV
budget is requested - weights - activations - CUDA graphs - non-torch memory
(v1/worker/gpu_worker.py Worker.determine_available_memory), cut into pages of block_size tokens
over that stage's attention layers, and every stage gets the smallest block count
(v1/core/kv_cache_utils.py get_kv_cache_configs). A pinned KV size (--kv-cache-memory-bytes)
stays pinned: the same bytes then hold fewer tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...inputs.model import ModelSpec
from . import budget as B
from . import kvcache as K


def rebudget(spec: ModelSpec, cand: Any, kv_pinned: bool, *, extra_weights_last: int = 0,
             extra_layers_last: int = 0, d_activation: int = 0, d_cudagraph: int = 0,
             d_non_torch: int = 0, pinned_bytes: int | None = None) -> Any:
    """A copy of the planner Candidate `cand` with the changes applied: weights and KV layers
    added to the last pipeline stage (where vLLM puts a draft model; its attention layers join
    the target's KV cache groups: kv_cache_utils.get_kv_cache_configs merges every worker's
    layers), and per-GPU activation, CUDA-graph and non-torch deltas. The pool is regrouped
    with kvcache.build_pool, so hybrid targets stay exact too.
    `pinned_bytes`: the --kv-cache-memory-bytes vLLM will get (default: the candidate's)."""
    base = list(cand.pool_layers)
    extra = next((x for x in base if x.grows_with_context()), base[-1]) if base else None
    layers = base + [extra] * extra_layers_last if extra is not None else base
    pool = K.build_pool(layers, cand.block_size)
    n_target = len(base)
    ranges = B.pp_stages(n_target, cand.layout.pp)
    ranges[-1] = range(ranges[-1].start, n_target + extra_layers_last)
    stages = [dict(s) for s in (cand.stages or [{"layers": n_target,
                                                  "weights_bytes": cand.weights,
                                                  "kv_cache_bytes": cand.kv_memory}])]
    stages[-1]["weights_bytes"] += extra_weights_last
    stages[-1]["layers"] += extra_layers_last
    activation = max(0, cand.activation + d_activation)
    cudagraph = max(0, cand.cudagraph + d_cudagraph)
    non_torch = max(0, cand.non_torch + d_non_torch)
    overhead = activation + cudagraph + non_torch
    on = [r if len(ranges) > 1 else None for r in ranges]
    block_bytes = [pool.bytes_per_block(r) for r in on]
    avail = [(pinned_bytes or cand.kv_memory) if kv_pinned
             else cand.requested - s["weights_bytes"] - overhead for s in stages]
    n = min(B.kv_blocks(a, bb) if a > 0 else 0 for a, bb in zip(avail, block_bytes, strict=True))
    for s, bb in zip(stages, block_bytes, strict=True):
        s["kv_cache_bytes"] = n * bb
    d = dataclasses.replace(cand.demand, max_len=cand.max_model_len)
    cap = K.capacity(pool, n, d)
    cache = {**cand.cache, "kinds": pool.kinds(), "groups": len(pool.groups),
             "blocks_per_request": cap.blocks_per_request, "block_bytes": max(block_bytes),
             "engine_concurrency": cap.concurrency}
    out = dataclasses.replace(
        cand, weights=max(s["weights_bytes"] for s in stages), activation=activation,
        cudagraph=cudagraph, non_torch=non_torch, kv_memory=n * max(block_bytes),
        kv_bytes_per_token=K.context_bytes_per_token(
            [layers[i] for i in max(ranges, key=len)]),
        blocks=n, tokens=cap.tokens, stages=stages, cache=cache, pool_layers=tuple(layers))
    if not all(a > 0 and K.fits(pool, a, d, r) for a, r in zip(avail, on, strict=True)):
        out.fits = False
        out.problem = (f"the KV cache would hold {n:,} blocks, fewer than one "
                       f"{cand.max_model_len:,}-token request needs")
    return out
