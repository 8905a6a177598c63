"""The range each flag the doctor may suggest can physically take, and the check that holds a
suggestion to it.

The doctor computes fixes from a log's numbers, and a log is input like any other: a hand-made
or corrupted one with free memory above the total, or an "estimated maximum model length" of
1e26, made it suggest --gpu-memory-utilization 1.02 and --max-model-len 1e26 (issue 31). A
suggestion outside its range is dropped, with a line saying the log's numbers are not sound,
rather than printed as a command to run.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["RANGES", "out_of_range"]

# dest -> (lowest, highest, whole number?). Sources:
# - utilization: vllm/config/cache.py, CacheConfig.gpu_memory_utilization Field(gt=0, le=1);
#   the doctor never suggests below 0.05 (_fix_free_memory's own floor);
# - context: the longest published context is 10M tokens (Llama 4 Scout); 2^24 leaves room;
# - KV bytes: at most the memory of the largest node (8 x 288 GB GB300 ~ 2.3e12), 2^42 = 4.4e12;
# - max-num-seqs, batched tokens: vllm/config/scheduler.py (ge=1); above 2^20 no engine runs;
# - tensor parallelism: at most the GPUs of the largest cluster vlaunch plans (launcher caps).
RANGES: dict[str, tuple[float, float, bool]] = {  # by vLLM's dest (the flag table's key)
    "gpu_memory_utilization": (0.05, 1.0, False),
    "max_model_len": (1, 1 << 24, True),
    "kv_cache_memory_bytes": (1, 1 << 42, True),
    "max_num_seqs": (1, 1 << 20, True),
    "max_num_batched_tokens": (1, 1 << 24, True),
    "tensor_parallel_size": (1, 4096, True),
    "port": (1, 65535, True),
}


def out_of_range(args: list[str]) -> str | None:
    """The first "--flag value" in `args` outside its range, as text; None when all are in."""
    from ..inputs.vllm_flags import spec_of  # the one spelling of each flag

    for i, flag in enumerate(args[:-1]):
        spec = spec_of(flag) if flag.startswith("--") else None
        bounds = RANGES.get(spec.dest) if spec is not None else None
        if bounds is None:
            continue
        low, high, whole = bounds
        value: Any = args[i + 1]
        try:
            number = float(value)
        except ValueError:
            return f"{flag} {value[:40]}"
        if not math.isfinite(number) or not low <= number <= high \
                or (whole and not number.is_integer()):
            return f"{flag} {value[:40]}"
    return None
