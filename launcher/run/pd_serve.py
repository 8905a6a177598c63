"""`vlaunch serve MODEL --disaggregate on` on one machine: a prefill and a decode engine, each
planned for its share of the hardware, with the P/D proxy in front.

Each engine runs under the same supervision as an aggregated one (`runner.VllmRunner`: its own
process group, readiness on /health and /v1/models, a log per engine); then the proxy
(`pd_proxy.PDProxy`) listens on `--port` and one short completion goes through it, so a
deployment said to serve has moved a prompt's KV from one engine to the other. A signal
(SIGTERM, SIGINT, SIGHUP) is forwarded to both engines at once (`runner.forward_signals`, the
handler `serve` uses for one), so a start-up or smoke wait ends at once; both engines and the
proxy stop and the exit is 128 + the signal; an engine that dies takes the other down with it
(exit 1): a half deployment serves nobody.

The connector: NixlConnector on GPUs (the production path llm-d deploys); on the CPU engine
ExampleConnector, which moves KV through a folder both engines share (vLLM's NIXL CPU path
needs the `nixl` wheel, which this project does not install). ExampleConnector is vLLM's
example, not a product: in 0.32 it stores a prompt under its first (n - 1) // 16 * 16 tokens and
looks it up under (n - 2) // 16 * 16, so a prompt of n = 1 (mod 16) tokens is recomputed on the
decode engine rather than loaded (v1/example_connector.py align_to_block_size).
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..inputs.hardware import Hardware
from ..inputs.model import ModelSpec
from ..predict.features import connectors
from ..predict.search.pd_pools import refuse_unsplittable
from ..predict.search.planner import Pins, Plan, make_plan
from ..predict.speed.disagg import pool_hardware
from ..redact import redact_args
from ..term import command as command_lines
from ..term import width
from .drain import DEFAULT_STOP_TIMEOUT_S
from .endpoint import Endpoint
from .pd_proxy import PDProxy, Upstream
from .runner import VllmRunner, forward_signals
from .vllmargs import free_port


@dataclass(frozen=True)
class PoolLaunch:
    """One engine of the deployment: its role, plan, argv and environment."""

    role: str
    plan: Plan
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]


def pool_launches(spec: ModelSpec, hw: Hardware, pins: Pins, extra: list[str], *,
                  store: str | None, connector: str | None = None) -> list[PoolLaunch]:
    """Plan each pool for its share of `hw` and give it its side of the KV hand-off."""
    refuse_unsplittable(hw, "serve aggregated (--disaggregate off)")
    share = pool_hardware(hw)
    name = connector or ("ExampleConnector" if hw.is_cpu else "NixlConnector")
    out = []
    transfers = None
    for i, role in enumerate(connectors.ROLES):
        plan = make_plan(spec, share, pins, suggest=False)
        if not plan.fits:
            raise InputError(f"the {role} pool does not fit on its share ({share.describe()}): "
                             f"{plan.chosen.problem}; give more GPUs or pin a shorter "
                             f"--max-model-len")
        if transfers is None:
            tp = plan.chosen.layout.tp
            connectors.check(name, plan.vllm_version, tp, tp, spec.attention == "mla")
            transfers = connectors.pool_transfers(name, cpu=hw.is_cpu, store=store)
        t = transfers[role]
        env = {**plan.env(), **t.env()}
        if not hw.is_cpu:  # each pool on its own GPUs of the node
            n = share.count
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(i * n, (i + 1) * n))
        args = [*plan.vllm_args(), *t.argv(plan.vllm_version), *extra]
        out.append(PoolLaunch(role, plan, tuple(args), tuple(sorted(env.items()))))
    return out


def serve_disaggregated(spec: ModelSpec, hw: Hardware, pins: Pins, extra: list[str], *,
                        port: int | None, host: str | None = None, log_dir: Path,
                        dry_run: bool = False, startup_timeout: float | None = None,
                        stop_timeout: float = DEFAULT_STOP_TIMEOUT_S,
                        smoke_timeout: float = 300.0, store: str | None = None,
                        out: Callable[[str], None] = print,
                        on_ready: Callable[[PDProxy, list[VllmRunner]], None] | None = None,
                        ) -> int:
    """Run the deployment until a signal or an engine's exit; the exit code."""
    bind = host or "127.0.0.1"
    port = port if port is not None else free_port(bind)
    with contextlib.ExitStack() as stack:
        if store is None and hw.is_cpu:
            store = stack.enter_context(tempfile.TemporaryDirectory(prefix="vlaunch-kv-"))
        launches = pool_launches(spec, hw, pins, extra, store=store)
        engine_ports = [free_port("127.0.0.1") for _ in launches]
        for pl, p in zip(launches, engine_ports, strict=True):
            out(f"{pl.role} engine ({pl.plan.chosen.label()}), port {p}:")
            argv = ["vllm", "serve", *redact_args([*pl.args, "--port", str(p)])]
            for line in command_lines(argv, width() - 2, env=dict(pl.env)):
                out("  " + line)
        out(f"P/D proxy: http://{bind}:{port} (prefill :{engine_ports[0]}, "
            f"decode :{engine_ports[1]})")
        if dry_run:
            return 0
        got: list[int] = []
        wake = threading.Event()

        def stopped(signum: int) -> None:
            if not got:
                got.append(signum)
            wake.set()

        runners: list[VllmRunner] = []
        stack.enter_context(forward_signals(runners, on_signal=stopped))
        for pl, p in zip(launches, engine_ports, strict=True):
            if got:  # a signal before every engine started: start no more
                return 128 + got[0]
            r = VllmRunner([*pl.args, "--port", str(p)], dict(pl.env),
                           log_path=log_dir / f"vllm-{pl.role}.log",
                           startup_timeout=startup_timeout or 900.0, grace_period=stop_timeout)
            runners.append(r)
            stack.callback(r.stop)
            r.start()
        for pl, r in zip(launches, runners, strict=True):
            outcome = r.wait_ready()
            if got:
                return 128 + got[0]
            if not outcome.ready:
                out(f"the {pl.role} engine did not start: {outcome.reason} "
                    f"(log: {r.log_path}); run `vlaunch doctor {r.log_path}`")
                return 1
        proxy = PDProxy(Upstream("127.0.0.1", engine_ports[0]),
                        Upstream("127.0.0.1", engine_ports[1]), host=bind, port=port).start()
        stack.callback(proxy.shutdown)
        name = runners[1].model_name
        smoke = Endpoint("127.0.0.1" if bind in ("0.0.0.0", "::") else bind, proxy.server_port,
                         name, [], {}, 10.0).smoke_test(
            "Hello, my name is", 2, smoke_timeout, lambda: got[0] if got else None)
        if got:
            return 128 + got[0]
        if not smoke.ok:
            out(f"a completion through the proxy failed: {smoke.error}")
            return 1
        out(f"serving {name} disaggregated on http://{bind}:{proxy.server_port}: a "
            f"completion went prefill -> decode in {smoke.seconds:.1f} s")
        if on_ready is not None:
            on_ready(proxy, runners)
        while not wake.wait(0.5):
            for pl, r in zip(launches, runners, strict=True):
                if r.poll() is not None and not got:  # not the exit a signal asked for
                    out(f"the {pl.role} engine exited ({r.returncode}); stopping the other "
                        f"(log: {r.log_path})")
                    return 1
        return 128 + got[0] if got else 0
