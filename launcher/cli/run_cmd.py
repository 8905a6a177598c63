"""Commands that start or read a vLLM run: serve, exec, tune, doctor."""

from __future__ import annotations

import sys

import click

from .. import term
from ..errors import InputError
from ..inputs import vllm_flags as F
from .group import cli, format_option
from .options import hardware as _hardware
from .options import pins as _pins
from .options import plan_options, revision_option, scaling_options, split_goals


def _serve_options(f):
    opts = [
        click.option("--max-attempts", type=click.IntRange(1, 10), default=3, show_default=True,
                     help="Start-up attempts, each re-planned from the last failure."),
        click.option("--metrics-port", type=click.IntRange(0, 65535), default=9400,
                     show_default=True, help="vlaunch exporter port (0: any free port)."),
        click.option("--metrics-bind", default="127.0.0.1", show_default=True),
        click.option("--no-metrics", is_flag=True, help="Do not start the exporter."),
        click.option(F.flag("port"), type=int, help="vLLM's API port (default: a free port)."),
        click.option(F.flag("host"), help="Address vLLM listens on [default: 127.0.0.1, this "
                                          "machine only]; 0.0.0.0 for every interface (then "
                                          "set VLLM_API_KEY)."),
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


def _run_serve(spec, hw, pins, extra, opts, goals=None, fixed=None) -> None:
    import dataclasses
    import json
    from pathlib import Path

    from ..run.serve import serve

    log_dir = Path(opts["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    from ..term import fit, width

    as_json = opts["fmt"] == "json"  # progress goes to stderr, one JSON document to stdout
    cols = width(sys.stderr if as_json else sys.stdout)

    def out(text: str) -> None:
        for line in fit([text], cols):  # long messages wrap under their own indent
            term.echo(line, err=as_json)

    result = serve(spec, hw, pins, list(extra), max_attempts=opts["max_attempts"],
                   quiet=opts["quiet"], verbose=opts["verbose"], dry_run=opts["dry_run"],
                   metrics_port=None if opts["no_metrics"] else opts["metrics_port"],
                   metrics_bind=opts["metrics_bind"], log_dir=log_dir,
                   startup_timeout=opts["startup_timeout"], port=opts["port"],
                   stop_timeout=_stop_timeout(opts),
                   out=out, goals=goals, host=opts["host"],
                   fixed=fixed)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(result), indent=2, default=str))
    sys.exit(result.exit_code)


_SERVE_KEYS = ("max_attempts", "metrics_port", "metrics_bind", "no_metrics", "port", "host",
               "startup_timeout", "stop_timeout", "log_dir", "quiet", "verbose", "dry_run",
               "fmt")


def _stop_timeout(opts: dict) -> float:
    from ..run.drain import DEFAULT_STOP_TIMEOUT_S

    value = opts["stop_timeout"]
    return float(DEFAULT_STOP_TIMEOUT_S if value is None else value)


@cli.command("serve", context_settings={"ignore_unknown_options": False})
@click.argument("model")
@revision_option
@plan_options
@scaling_options
@_serve_options
@click.option("--disaggregate", type=click.Choice(["on", "off"]), default="off",
              show_default=True,
              help="on: a prefill and a decode engine on this machine, each on half of it, "
                   "behind a P/D proxy on --port.")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def serve_cmd(model: str, revision: str | None, gpus: str | None, extra: tuple[str, ...],
              disaggregate: str, **kw) -> None:
    """Plan MODEL, start vLLM on the plan, verify it, recover, and keep it serving.

    Arguments after `--` go to vLLM; a flag given there replaces the plan's (reported), and
    --tensor/pipeline/data-parallel-size there are pins. Exit: vLLM's status, 3 when the plan
    does not fit, 2 for bad input, 128+N when stopped by signal N (143 SIGTERM, 130 SIGINT).
    """
    from ..inputs.model import load_model

    opts = {k: kw.pop(k) for k in _SERVE_KEYS}
    goals = split_goals(kw)
    spec = load_model(model, revision)
    if disaggregate == "on":
        _run_disaggregated(spec, _hardware(gpus), _pins(**kw), extra, opts)
    _run_serve(spec, _hardware(gpus), _pins(**kw), extra, opts, goals)


def _run_disaggregated(spec, hw, pins, extra, opts) -> None:
    from pathlib import Path

    from ..run.pd_serve import serve_disaggregated

    log_dir = Path(opts["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    rc = serve_disaggregated(spec, hw, pins, list(extra), port=opts["port"], host=opts["host"],
                             log_dir=log_dir, dry_run=opts["dry_run"],
                             startup_timeout=opts["startup_timeout"],
                             stop_timeout=_stop_timeout(opts),
                             out=lambda s: term.echo(s, err=opts["fmt"] == "json"))
    sys.exit(rc)


@cli.command("exec")
@click.option("--plan", "plan_path", required=True, type=click.Path(),
              help="plan.json (or its folder) written by `vlaunch plan --emit`.")
@click.option("--role", type=click.Choice(["leader", "worker"]),
              help="Multi-node role (default: from LWS_WORKER_INDEX).")
@click.option("--replan", is_flag=True,
              help="Plan again from the plan's model and decisions (for the memory free now, "
                   "and after a failed start) instead of running the plan as it is.")
@_serve_options
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def exec_cmd(plan_path: str, role: str | None, replan: bool, extra: tuple[str, ...],
             **kw) -> None:
    """Start vLLM on an emitted plan (the main container of the init-container pattern).

    It runs what the plan says and never plans again unless --replan is given. Exit: vLLM's
    status, 3 when the plan does not fit or the GPUs' free memory no longer holds it, 2 for a
    bad plan.json, 128+N when stopped by signal N."""
    import os
    from pathlib import Path

    from ..run.emit import load_plan
    from ..run.exec_check import check_exec_plan

    opts = {k: kw.pop(k) for k in _SERVE_KEYS}
    dep = load_plan(plan_path)  # one line naming a missing or mistyped field, exit 2
    plan_dir = str(Path(plan_path) if Path(plan_path).is_dir() else Path(plan_path).parent)
    check_exec_plan(dep, plan_dir)
    from ..run.exec_plan import check_pool_plan

    check_pool_plan(dep, replan)  # a disaggregated plan runs one pool: the one it names
    if dep.engine.parallel.nodes > 1 or role or os.environ.get("LWS_WORKER_INDEX"):
        from ..run.multinode import build_launch
        from ..run.serve import run_node

        launch = build_launch(dep, role=role, plan_dir=plan_dir)
        log_dir = Path(opts["log_dir"])
        log_dir.mkdir(parents=True, exist_ok=True)
        as_json = opts["fmt"] == "json"
        rc = run_node(launch, dep, port=opts["port"],
                      metrics_port=None if opts["no_metrics"] else opts["metrics_port"],
                      metrics_bind=opts["metrics_bind"], log_dir=log_dir,
                      dry_run=opts["dry_run"], verbose=opts["verbose"],
                      startup_timeout=opts["startup_timeout"],
                      stop_timeout=_stop_timeout(opts), extra=list(extra),
                      out=lambda s: term.echo(s, err=as_json), host=opts["host"])
        if as_json:
            import json

            click.echo(json.dumps({"exit_code": rc, "role": launch.role,
                                   "node_rank": launch.node_rank}, indent=2))
        sys.exit(rc)
    if replan:
        from ..predict.search.plan_inputs import inputs_from_plan, replan_pins
        from ..run.exec_plan import goals_from_plan, live_hardware

        spec, hw, pins = inputs_from_plan(dep)
        _run_serve(spec, live_hardware(dep, hw), replan_pins(dep, pins), extra, opts,
                   goals_from_plan(dep))
        return
    from ..run.exec_plan import live_misfit

    if why := live_misfit(dep):
        term.echo(f"vlaunch: {why}", err=True)
        sys.exit(3)
    _run_serve(None, None, _pins(), extra, opts, fixed=dep)


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

    from ..inputs.model import load_model
    from ..inputs.prompts import load_prompts
    from ..run import tune

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
    from ..run import preflight

    preflight.check(hw)  # vLLM imports and the GPUs are here: else one line, exit 2
    say = (lambda s: None) if fmt == "json" else term.echo  # noqa: E731
    status, doc = tune.tune(spec, hw, pins, opts, out=say,
                            log=lambda s: term.echo(s, err=True))
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

    SOURCE is a vLLM log, a folder of logs (each diagnosed, newest first), or - for stdin
    (kubectl logs POD | vlaunch doctor -). With --plan, or MODEL (and --gpus and plan
    options), each fix is planned with the failed launch's settings plus the fix. Exit 0 when
    no failure is found, 1 when one is, 2 for bad input.
    """
    import json

    from ..observe import doctor

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
        from ..run.emit import load_plan

        dep = load_plan(plan_path)
        # a disaggregated plan names the failed pool (observe/pool_role.py); its fixes are the
        # log's own until a pool can be re-planned alone
        ctx = doctor.context_from_plan(dep) if dep.kind == "aggregated" else None
    elif model:
        goals = split_goals(kw)
        ctx = doctor.context_from_model(model, gpus, _pins(**kw), goals, _hardware(gpus))
    logs = doctor.diagnose_all(source, ctx, plan=dep if plan_path else None)
    if fmt == "json":
        click.echo(json.dumps(doctor.to_json(logs), indent=2))
    else:
        term.echo(doctor.render_all(logs, term.width()))
    sys.exit(1 if any(report.diagnoses for _, report in logs) else 0)

