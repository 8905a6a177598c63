"""Commands that plan and read, never start vLLM: plan, capacity, profiles, gpus, exporter."""

from __future__ import annotations

import sys

import click

from .. import term
from ..errors import InputError, NotFitError
from .group import cli, format_option
from .options import (
    build_deployment,
    check_role,
    disaggregate_options,
    pin_option,
    plan_options,
    revision_option,
    role_option,
    scaling_options,
    split_goals,
    workload_options,
)
from .options import pins as _pins


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
@click.option("--relay-vllm/--no-relay-vllm", default=None,
              help="End the page with vLLM's own /metrics, so Prometheus needs only this port "
                   "(default: VLAUNCH_METRICS_RELAY=1 turns it on; the manifests do).")
@click.option("--role", type=click.Choice(["prefill", "decode"]),
              help="The pool of a disaggregated plan this engine is (default: the pool an "
                   "emitted folder names, `plan --role R --emit`, else the first); its series "
                   "carry the label role.")
@format_option("text: what it serves, one line each; json: the same as JSON lines "
               "({\"message\": ...}) for log collectors.")
def exporter_cmd(vllm_url: str, plan_path: str | None, port: int, bind: str, timeout: float,
                 cache_ttl: float, relay_vllm: bool | None, role: str | None, fmt: str) -> None:
    """Serve vlaunch's KV-cache and plan gauges for Prometheus on /metrics."""
    from ..observe import exporter
    from ..run.emit import load_plan, startup_deadline_s

    plan = load_plan(plan_path) if plan_path else None
    exp = exporter.Exporter(vllm_url, plan=plan, timeout_s=timeout, cache_ttl_s=cache_ttl,
                            startup_timeout_s=startup_deadline_s if plan else None,
                            relay_vllm=relay_vllm, role=role)
    if fmt == "json":
        import json

        def echo(s: str) -> None:
            click.echo(json.dumps({"message": s}))
    else:
        echo = term.echo
    exporter.run_forever(exp, port, bind, echo)


@cli.command("gpus")
@format_option("text: a table for people; json: for scripts.")
def gpus_cmd(fmt: str) -> None:
    """List the GPUs this process may use, as NVML reads them now."""
    import json

    from ..inputs import inventory

    try:
        inv = inventory.read_inventory()
    except inventory.NoGPUError as e:
        raise inventory.no_gpu_for_gpus(e) from None
    if fmt == "json":
        click.echo(json.dumps(inv.to_dict(), indent=2))
    else:
        # the usage bars are coloured by term.echo, on a terminal only
        term.echo(inventory.render_table(inv, color=False, width=term.width()))


def format_plan(dep, fmt: str) -> str:
    """Deployment `dep` in `fmt`: the codec's JSON (or YAML), vLLM's flags, or the text."""
    import json

    from ..deployment.argv import pool_argv
    from ..deployment.codec import dump
    from ..render import plan_text

    d = dump(dep) if fmt in ("json", "yaml") else None
    if fmt == "json":
        return json.dumps(d, indent=2)
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(d, sort_keys=False)
    if fmt == "args":  # the pool it runs: the aggregated one, or the one --role names
        return "\n".join(pool_argv(dep.pool) if dep.fits else [])
    return plan_text(dep)


_FORMAT_NAMES = {"text": "text", "txt": "text", "json": "json", "yaml": "yaml", "yml": "yaml",
                 "args": "args", "table": "text"}


def _warn_format_named(output: str) -> None:
    """`-o json` means `--output json` (a file named json), never `--format json`: say so, as
    the file silently gets the --format text would otherwise surprise."""
    from pathlib import Path

    fmt = _FORMAT_NAMES.get(Path(output).name.lower())
    if fmt:
        term.echo(f"vlaunch: warning: writing to a file named '{output}'; -o names the output "
                  f"file, the format is chosen with --format {fmt}", err=True)


def _write_atomic(path: str, text: str) -> None:
    from ..paths import atomic_write

    atomic_write(path, text if text.endswith("\n") else text + "\n")


@cli.command("plan")
@click.argument("model")
@revision_option
@plan_options
@scaling_options
@disaggregate_options
@role_option
@format_option("text for people; json or yaml for scripts; args: vLLM's flags, one a line.",
               "yaml", "args")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to FILE (atomic).")
@click.option("--emit", "emit_dir", type=click.Path(file_okay=False),
              help="Write plan.json, vllm-args and vllm.env into DIR (init-container mode; a "
                   "disaggregated plan: one pool's, with --role).")
@click.option("--termination-log", default="/dev/termination-log", show_default=True,
              help="With --emit: where a does-not-fit explanation goes (if the file exists).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Draw the chosen layout's throughput-latency curve and the runner-ups' to a "
                   "PNG (needs matplotlib: pip install 'vlaunch[plot]').")
def plan_cmd(model: str, revision: str | None, gpus: str | None, fmt: str,
             output: str | None, emit_dir: str | None, termination_log: str,
             plot_path: str | None, role: str | None, **pins) -> None:
    """Plan MODEL: a profile, a Hugging Face id (ORG/NAME: the local HF cache, then the Hub;
    weights are never downloaded), or a local model dir / config.json.

    Exit 0 when it fits, 3 when it does not, 2 for bad input.
    """
    if output:
        _check_folder(output, "-o")
    check_role(role, pins.get("disaggregate"))
    if emit_dir and not role and pins.get("disaggregate") == "on":
        raise InputError("--emit writes one engine's files (one pod); emit each pool of a "
                         "disaggregated plan in its own folder with --role prefill or --role "
                         "decode, or plan aggregated (--disaggregate off)")
    if emit_dir and not role:  # the init container runs one engine: its plan stays aggregated
        pins["disaggregate"] = "off"
    dep = build_deployment(model, gpus, revision, **pins)
    if role:  # the whole deployment, naming the pool this invocation writes (deterministic)
        from ..run.emit import pool_plan

        dep = pool_plan(dep, role)
    if plot_path:
        if dep.kind == "disaggregated":
            click.echo(f"vlaunch: warning: --plot {plot_path}: nothing drawn, a disaggregated "
                       "plan has one rate-matched operating point, not a curve (its figures "
                       "are in the text and JSON)", err=True)
        elif dep.fits:
            from ..plot import plan_plot

            plan_plot(dep, plot_path)
        else:
            term.echo(f"vlaunch: warning: --plot {plot_path}: nothing drawn, the plan does not "
                      "fit (no performance to plot)", err=True)
    if emit_dir:  # before printing: a folder that cannot be written is one line, not a plan
        from ..run.emit import emit_plan, write_termination_message

        if not dep.fits:
            write_termination_message(format_plan(dep, "text"), termination_log)
        else:
            emit_plan(dep, emit_dir)
    text = format_plan(dep, fmt)
    if output:
        _warn_format_named(output)
        _write_atomic(output, text)
    else:
        if fmt == "text":
            term.echo(_fit(text))
        else:
            click.echo(text)
    if not dep.fits:
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

    cols = term.width()
    out: list[str] = []
    for line in text.split("\n"):
        stripped = line.lstrip()
        if (" vllm serve " in line or stripped.startswith(("vllm serve ", "python -m vllm."))
                or " python -m vllm." in line):
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
@click.option("--prices", "prices_file", type=click.Path(dir_okay=False),
              help="YAML of your prices per GPU-hour by GPU and shape, with source and date "
                   "(launcher/schemas/profiles/prices.json); --price wins over it.")
@click.option("--mix", is_flag=True,
              help="Find the cheapest combination of the --gpus types for the load (needs "
                   "--rps), each serving the lengths it is cheapest for (an ILP).")
@click.option("--lengths", "lengths_file", type=click.Path(dir_okay=False),
              help="With --mix: a YAML prompt/output length histogram "
                   "(launcher/schemas/profiles/lengths.json); default: the workload's lengths.")
@click.option("--headroom", type=float, default=0.2, show_default=True,
              help="Spare capacity as a fraction of the load.")
@click.option("--spare", type=int, default=0, show_default=True,
              help="Extra replicas for failures and rollouts.")
@pin_option("max_model_len", help="Context each replica serves (default: full).")
@click.option("--vllm-version", help="Plan for this vLLM version (default: installed).")
@click.option("--mtp/--no-mtp", "speculative", default=None,
              help="Pin MTP speculative decoding on or off for every option (default: each "
                   "option's plan decides, as `vlaunch plan` does).")
@format_option("text: a table for people; json: for scripts.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Draw each option's throughput-latency curve to a PNG (needs matplotlib).")
@click.option("--disaggregate", type=click.Choice(["auto", "on", "off"]), default="auto",
              show_default=True,
              help="auto/on: also price each option as prefill and decode pools and say which "
                   "wins; off: aggregated options only.")
def capacity_cmd(model: str, revision: str | None, users: int | None, rps: float | None,
                 gpu_options: tuple[str, ...],
                 prices: tuple[str, ...], prices_file: str | None, mix: bool,
                 lengths_file: str | None, headroom: float, spare: int,
                 max_model_len: int | None, vllm_version: str | None,
                 speculative: bool | None, fmt: str, plot_path: str | None, disaggregate: str,
                 **kw) -> None:
    """How many GPUs, and what per month, to serve MODEL to N users (or R requests/s).

    Each option's replica is the plan `vlaunch plan` makes for it. Exit 0 with a
    recommendation, 3 when no option meets the SLO (naming the closest miss), 2 for bad input.
    """

    from ..inputs.model import load_model
    from ..predict.capacity import capacity
    from ..predict.capacity.prices import PriceBook, parse_prices, read_prices_file

    goals = split_goals(kw)
    load = capacity.Load(users=users, rps=rps)
    load.validate()
    options = [g.strip() for item in gpu_options for g in item.split(",") if g.strip()]
    book = read_prices_file(prices_file) if prices_file else PriceBook()
    book.flat.update(parse_prices(prices))
    if lengths_file and not mix:
        raise InputError("--lengths is for --mix: add --mix, or give --input-len/--output-len")
    spec = load_model(model, revision)
    args = (spec, load, goals["workload"], goals["slo"], options or None, book, headroom, spare,
            _pins(max_model_len=max_model_len, vllm_version=vllm_version,
                  speculative=speculative))
    if mix:
        from ..predict.capacity import mix as mixing

        d = mixing.plan_capacity_mix(*args, objective=goals["objective"], lengths=lengths_file)
    else:
        d = capacity.plan_capacity(*args, objective=goals["objective"])
        if disaggregate != "off":
            from ..predict.capacity.capacity_pd import add_disaggregated

            add_disaggregated(d, spec, load, goals["workload"], goals["slo"], book, headroom,
                              spare, args[-1])
    if plot_path:
        from ..plot import capacity_plot

        capacity_plot(d, plot_path)
    if fmt == "json":
        click.echo(capacity.capacity_json(d))
    else:
        term.echo(capacity.render(d, term.width()))
        if "disaggregated" in d:
            from ..predict.capacity.capacity_pd import render_lines

            term.echo(_fit("\n".join(render_lines(d))))
        if mix:
            term.echo("\n".join(mixing.render_mix(d["mix"], term.width())))
    if d["recommended"] is None:
        raise NotFitError(capacity.miss_message(d))


@cli.command("profiles")
@format_option("text: a table for people; json: for scripts.")
def profiles_cmd(fmt: str) -> None:
    """Built-in models: size, context, attention type."""
    import json

    from ..inputs.model import list_profiles
    from ..predict.memory.budget import GiB, checkpoint_scale, param_count, weights_bytes

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
    term.echo(f"{'name':24} {'params':>9} {'weights':>10} {'context':>8}  attention  quant")
    for r in rows:
        term.echo(f"{r['name']:24} {r['params'] / 1e9:>8.1f}B "
                  f"{r['weights_bytes'] / GiB:>6.1f} GiB "
                  f"{r['max_context']:>8,}  {r['attention']:9}  {r['quantization']}")

