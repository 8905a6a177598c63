"""Which pool of a prefill/decode deployment a failed engine was, read from its log.

vLLM logs its non-default args at start-up; a P/D engine's include `kv_transfer_config` (the
connector and kv_role: inputs/vllm_failures.py reads its repr). kv_producer is a prefill
engine and kv_consumer a decode one; vlaunch runs both pools kv_both (the role a request
plays comes from its kv_transfer_params:
predict/features/connectors.py), so then the role comes from
the plan given with --plan (the pool an emitted pool's folder names, `plan --role R --emit`,
else the pool whose engine has the log's layout and batch limits), or
from the log's file name (`vlaunch serve --disaggregate on` writes vllm-prefill.log and
vllm-decode.log). The doctor says it beside the root cause, so a reader knows which pool to fix.
"""

from __future__ import annotations

import os
from typing import Any

from ..deployment.plan import Deployment, Pool
from ..inputs.vllm_failures import Facts

BY_KV_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode"}
ROLES = ("prefill", "decode")
# the log's args that tell two pools' engines apart, and each pool engine's value (vLLM default)
_SHAPE = (("tensor_parallel_size", lambda p: p.engine.parallel.tp, 1),
          ("data_parallel_size", lambda p: p.engine.parallel.dp, 1),
          ("max_num_seqs", lambda p: p.engine.max_num_seqs, None),
          ("max_num_batched_tokens", lambda p: p.engine.max_num_batched_tokens, None))


def _matches(pool: Pool, facts: Facts) -> bool:
    for dest, value_of, default in _SHAPE:
        got = facts.arg(dest)
        got = default if got is None else got
        if got is not None and got != value_of(pool):
            return False
    return True


def pool_of(facts: Facts, plan: Deployment | None = None,
            sources: list[str] | tuple[str, ...] = ()) -> dict[str, Any] | None:
    """{role, connector, kv_role, how} of a P/D engine's log; None for an aggregated one."""
    kv = facts.arg("kv_transfer_config")
    if not isinstance(kv, dict) or not kv.get("kv_connector"):
        return None
    connector, kv_role = str(kv["kv_connector"]), str(kv.get("kv_role") or "")
    role, how = BY_KV_ROLE.get(kv_role), "its kv_role"
    if role is None and plan is not None and plan.role is not None:
        role, how = plan.role, "the plan's role (the pool its folder runs)"
    if role is None and plan is not None and plan.kind == "disaggregated":
        found = {p.role for p in plan.pools if _matches(p, facts)}
        if len(found) == 1:
            role, how = found.pop(), "the plan's pool with the log's layout and batch limits"
    if role is None:
        named = {r for r in ROLES for s in sources if r in os.path.basename(str(s))}
        if len(named) == 1:
            role, how = named.pop(), "the log's file name"
    return {"role": role, "connector": connector, "kv_role": kv_role,
            "how": how if role else None}


def note(info: dict[str, Any]) -> str:
    """The line the doctor prints beside the root cause."""
    what = f"{info['connector']}, kv_role {info['kv_role'] or '?'}"
    if info["role"] is None:
        return (f"this engine was one pool of a prefill/decode deployment ({what}); its log "
                "does not say which: pass --plan to tell")
    return (f"this engine was the {info['role']} pool of a prefill/decode deployment ({what}; "
            f"known from {info['how']})")
