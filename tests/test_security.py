"""Issue 23: secrets never printed or replayed, every input bounded, a tampered plan refused.

Each test plays the attacker or the careless operator the review found, on loopback only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import stat
import string
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from plan_factory import deployment

from launcher import paths
from launcher.cli import cli
from launcher.deployment.argv import pool_argv
from launcher.deployment.codec import dump, load
from launcher.errors import InputError
from launcher.redact import REDACTED, SECRET_FLAGS, command_line_warning, redact_args, redact_env
from launcher.run import multinode

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


def _secret(rng: random.Random) -> str:
    """A key as users make them (never starting with '-', which vLLM would read as a flag)."""
    alphabet = string.ascii_letters + string.digits + "-_.:/+="
    return rng.choice(string.ascii_letters) + "".join(rng.choice(alphabet) for _ in range(30))


# ---- one redaction function ------------------------------------------------------------------


def _secret_argv(rng: random.Random) -> tuple[list[str], list[str], list[str]]:
    """(argv, the secrets in it, the other words in order) in every form vLLM's parser takes."""
    argv: list[str] = []
    hidden: list[str] = []
    kept: list[str] = []
    for _ in range(rng.randint(1, 6)):
        form = rng.choice(["plain", "key", "keys", "eq", "underscore", "token", "bare-token"])
        if form == "plain":
            words = rng.choice([["--max-num-seqs", str(rng.randint(1, 512))], ["--enforce-eager"],
                                ["--port", "8000"], ["--max-model-len", "4096"]])
            argv += words
            kept += words
            continue
        s = [_secret(rng) for _ in range(3 if form == "keys" else 1)]
        if form in ("key", "keys"):
            argv += ["--api-key", *s]
        elif form == "eq":
            argv.append(f"--{rng.choice(['api-key', 'hf-token'])}={s[0]}")
        elif form == "underscore":
            argv += ["--api_key", s[0]]
        elif form == "token":
            argv += ["--hf-token", s[0]]
        else:  # a bare --hf-token (the cached login) takes no value: the next flag stays
            argv += ["--hf-token", "--enforce-eager"]
            kept.append("--enforce-eager")
            continue
        hidden += s
    return argv, hidden, kept


def test_redact_args_hides_every_secret_and_keeps_everything_else():
    rng = random.Random(23)
    for _ in range(500):
        argv, hidden, kept = _secret_argv(rng)
        out = redact_args(argv)
        assert len(out) == len(argv)
        text = " ".join(out)
        for s in hidden:
            assert s not in text, (argv, out)
        assert [a for a in out if a in kept] == [a for a in argv if a in kept]
        assert out.count(REDACTED) + sum(a.endswith("=" + REDACTED) for a in out) == len(hidden)


def test_redact_env_hides_secret_names_only():
    env = {"VLLM_API_KEY": "k1", "HF_TOKEN": "t1", "HUGGING_FACE_HUB_TOKEN": "t2",
           "AWS_SECRET_ACCESS_KEY": "a", "VLLM_ENGINE_READY_TIMEOUT_S": "600",
           "VLLM_CACHE_ROOT": "/models/c", "EMPTY_TOKEN": ""}
    out = redact_env(env)
    assert {k for k, v in out.items() if v == REDACTED} == {
        "VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY"}
    assert out["VLLM_ENGINE_READY_TIMEOUT_S"] == "600" and out["EMPTY_TOKEN"] == ""


def test_secret_on_the_command_line_is_warned_about_with_the_env_name():
    for flag, env in SECRET_FLAGS.items():
        warning = command_line_warning(["--max-num-seqs", "4", flag, "x"])
        assert warning and "ps" in warning and env in warning
    assert command_line_warning(["--max-num-seqs", "4"]) is None


# ---- everywhere vlaunch prints or writes a command -------------------------------------------


def _emit(tmp_path: Path) -> Path:
    out = tmp_path / "emitted"
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpus", "1xH100", "--vllm-version",
                                 "0.32.0", "--emit", str(out)])
    assert r.exit_code == 0, r.output
    return out


@pytest.mark.parametrize("form", [["--api-key", "{k}"], ["--api-key={k}"],
                                  ["--api-key", "{k}", "{k2}"], ["--hf-token", "{k}"]])
def test_serve_and_exec_dry_runs_never_print_a_secret(tmp_path, monkeypatch, form):
    key, key2 = "sk-" + secrets.token_hex(12), "sk-" + secrets.token_hex(12)
    extra = [w.format(k=key, k2=key2) for w in form]
    monkeypatch.setenv("HF_TOKEN", "hf_" + secrets.token_hex(8))
    folder = _emit(tmp_path)
    runs = {
        "serve": ["serve", "llama-3.1-8b", "--gpus", "1xH100", "--dry-run", "--no-metrics",
                  "--", *extra],
        "exec": ["exec", "--plan", str(folder), "--dry-run", "--no-metrics", "--", *extra],
    }
    for name, argv in runs.items():
        r = CliRunner().invoke(cli, argv)
        assert r.exit_code == 0, (name, r.output)
        assert key not in r.output and key2 not in r.output, (name, r.output)
        assert os.environ["HF_TOKEN"] not in r.output
        assert REDACTED in r.output, name
        assert "visible to every local user" in r.output, name  # and steered to the env
        i = argv.index("--")
        r = CliRunner().invoke(cli, [*argv[:i], "--format", "json", *argv[i:]])
        assert r.exit_code == 0 and key not in r.output and key2 not in r.output, name
        assert REDACTED in " ".join(json.loads(r.stdout)["command"]), name


def test_multinode_exec_dry_run_never_prints_a_secret(tmp_path, monkeypatch):
    from launcher.run.serve import run_node

    key = "sk-" + secrets.token_hex(12)
    from launcher.inputs.hardware import parse_gpus
    from launcher.inputs.model import load_model
    from launcher.predict.search.planner import Pins, make_plan

    plan = make_plan(load_model("llama-3.1-70b"), parse_gpus("2x8xH100"),
                     Pins(tp=8, pp=2, vllm_version="0.32.0")).deployment()
    launch = multinode.build_launch(plan, environ={}, role="leader",
                                    leader_address="127.0.0.1")
    lines: list[str] = []
    rc = run_node(launch, plan, port=None, metrics_port=None, metrics_bind="127.0.0.1",
                  log_dir=tmp_path, dry_run=True, verbose=False, startup_timeout=5,
                  extra=["--api-key", key], out=lines.append)
    text = "\n".join(lines)
    assert rc == 0 and key not in text
    # the command wraps where the interpreter's path puts it: read it as words, not by line
    words = " ".join(lines[lines.index("  leader 0 would run:") + 1:]).replace("\\", " ").split()
    assert words[words.index("--api-key") + 1] == f"'{REDACTED}'"
    assert words[words.index("--host") + 1] == "127.0.0.1"  # the leader: loopback unless told


def test_tune_refuses_a_secret_in_a_candidate_before_recording_it(tmp_path):
    key = "sk-" + secrets.token_hex(12)
    for cand in (f"--api-key {key}", f"--max-num-seqs 8 --hf-token={key}",
                 f"--api-key '{key}"):  # malformed quoting: the error must not echo it either
        r = CliRunner().invoke(cli, ["tune", "llama-3.1-8b", "--gpus", "1xH100",
                                     "--candidate", cand, "--output", str(tmp_path / "t")])
        assert r.exit_code == 2, r.output
        assert key not in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
    assert not list(tmp_path.glob("t/*.json"))


# ---- a tampered multi-node plan -----------------------------------------------------------


def _mn_plan(env=None):
    """A typed two-node TP16 plan (tests/plan_factory.py)."""
    return deployment(tp=16, nodes=2, enable_chunked_prefill=True, env=env)


@pytest.mark.parametrize("env", [{"LD_PRELOAD": "/tmp/evil.so"}, {"PYTHONPATH": "/tmp"},
                                 {"VLLM_PLUGINS": "evil"}, {"HF_ENDPOINT": "http://evil"},
                                 {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
                                 {"VLLM_ENGINE_READY_TIMEOUT_S": ["x"]}])
def test_multinode_refuses_env_the_planner_never_writes(env):
    plan = _mn_plan({"VLLM_ENGINE_READY_TIMEOUT_S": "1800", **env})
    with pytest.raises(InputError, match="never writes"):
        multinode.build_launch(plan, environ={}, role="leader", leader_address="127.0.0.1")


@pytest.mark.parametrize("extra", [["--trust-remote-code"], ["--trust-remote-code=True"],
                                   ["--chat-template"], ["some-positional"],
                                   ["--max-num-seqs", "--trust-remote-code"],
                                   ["--enforce-eager=--x"], ["--allowed-local-media-path", "/"]])
def test_multinode_refuses_args_the_planner_never_writes(extra):
    # what a typed engine cannot hold reaches multinode only as a hand-edited plan.json, which
    # the codec refuses; the allow-list multinode runs on every argv refuses it as well
    plan = _mn_plan()
    raw = dump(plan)
    raw["pools"][0]["vllm_args"] += extra
    with pytest.raises(InputError, match="differ from the arguments"):
        load(raw)
    with pytest.raises(InputError, match="never writes"):
        multinode.check_plan_flags(pool_argv(plan.pool) + extra)


def test_every_plan_the_planner_makes_passes_the_multinode_allowlist():
    """The allowlist is not narrower than the planner: every profile on several machines."""
    from launcher.inputs.hardware import parse_gpus
    from launcher.inputs.model import load_model
    from launcher.predict.search.planner import Pins, make_plan

    models = sorted(p.stem for p in (REPO / "profiles" / "models").glob("*.yaml"))
    checked = 0
    for model in models:
        for gpus in ("1xH100", "8xH200", "2x8xH100", "cpu"):
            try:
                d = make_plan(load_model(model), parse_gpus(gpus), Pins()).to_dict()
            except InputError:
                continue
            multinode.check_plan_flags(d["vllm_args"])
            multinode.check_plan_env(d["env"])
            checked += 1
    assert checked >= len(models)


# ---- atomic_write respects the umask -----------------------------------------------------


@pytest.mark.parametrize("umask", [0o077, 0o027, 0o022, 0o002])
def test_atomic_write_gives_new_files_what_the_umask_allows(tmp_path, umask):
    old = os.umask(umask)
    try:
        target = paths.atomic_write(tmp_path / "plan.json", "{}\n")
        reference = tmp_path / "reference"
        reference.write_text("x")  # what open() makes under this umask
        assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(reference.stat().st_mode)
        assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
        assert paths.current_umask() == umask
    finally:
        os.umask(old)


# ---- bounds: --gpus, config.json ------------------------------------------------------------


@pytest.mark.parametrize("gpus", ["125000000x8xH100", "1000x1000000xH100", "1000000000xH100",
                                  "1x16xH100", "9" * 5000 + "xH100", "2x" + "9" * 5000 + "xH100",
                                  "4x" + "9" * 400 + "GiB", "100000x1x24GiB", "1x65x24GiB"])
def test_gpus_beyond_what_a_node_or_a_cluster_holds_is_one_line_at_once(gpus):
    from launcher.inputs import hardware

    started = time.monotonic()
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpus", gpus])
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and len(r.output) < 400, r.output
    assert time.monotonic() - started < 10  # minutes before the caps (a generous bound)
    with pytest.raises(InputError):
        hardware.parse_gpus(gpus)


def test_gpu_caps_leave_every_catalog_node_and_the_largest_cluster_plannable():
    from launcher.inputs import hardware

    for kind in hardware.kinds():
        hw = hardware.parse_gpus(f"2x{kind.max_per_node}x{kind.name}")
        assert hw.gpus_per_node == kind.max_per_node
    biggest = hardware.MAX_CLUSTER_GPUS // 8
    assert hardware.parse_gpus(f"{biggest}x8xH100").count == hardware.MAX_CLUSTER_GPUS
    assert hardware.parse_gpus("1x16x24GiB").gpus_per_node == 16


def test_divisors_are_all_the_divisors():
    from launcher.predict.memory.candidate_memory import _divisors

    rng = random.Random(7)
    for n in [1, 2, 16, 36, 97, 65536, *(rng.randint(1, 5000) for _ in range(200))]:
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    big = 2**20 * 3**5  # answers in O(sqrt n): the linear scan took seconds here
    assert _divisors(big)[-1] == big and len(_divisors(big)) == 21 * 6


def _numeric_leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numeric_leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numeric_leaves(v, (*path, i))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path


def test_a_config_with_a_non_finite_number_is_one_line_exit_2(tmp_path):
    """Any number of a real config replaced by NaN, Infinity or a literal that overflows to
    infinity: one line and exit 2, never a traceback."""
    from launcher.paths import read_yaml

    cfg = read_yaml(REPO / "profiles" / "models" / "deepseek-v2-lite.yaml")["config"]
    leaves = list(_numeric_leaves(cfg))
    assert len(leaves) > 10
    rng = random.Random(23)
    folder = tmp_path / "m"
    folder.mkdir()
    for path in rng.sample(leaves, 12):
        for literal in ("Infinity", "-Infinity", "NaN", "1e999", "9" * 400):
            doc = json.loads(json.dumps(cfg))
            part = doc
            for k in path[:-1]:
                part = part[k]
            part[path[-1]] = "@@X@@"
            (folder / "config.json").write_text(json.dumps(doc).replace('"@@X@@"', literal))
            r = CliRunner().invoke(cli, ["plan", str(folder), "--gpus", "1xH100"])
            assert r.exit_code == 2, (path, literal, r.output)
            assert len(r.output.strip().splitlines()) == 1, (path, literal, r.output)
    # a rope_scaling factor, the review's example
    doc = json.loads(json.dumps(cfg))
    doc.setdefault("rope_scaling", {})["factor"] = "@@X@@"
    (folder / "config.json").write_text(json.dumps(doc).replace('"@@X@@"', "Infinity"))
    r = CliRunner().invoke(cli, ["plan", str(folder), "--gpus", "1xH100"])
    assert r.exit_code == 2 and "finite" in r.output, r.output


# ---- exposure: vLLM on loopback unless told ----------------------------------------------------


def _dry(argv: list[str], env: dict[str, str] | None = None) -> tuple[list[str], str]:
    """The argv a dry run would execute (its JSON result) and everything it said."""
    if "--" in argv:
        i = argv.index("--")
        argv = [*argv[:i], "--format", "json", *argv[i:]]
    else:
        argv = [*argv, "--format", "json"]
    r = CliRunner().invoke(cli, argv, env=env)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["command"], r.output


def _host_of(words: list[str]) -> str | None:
    hosts = [words[i + 1] for i, w in enumerate(words) if w == "--host"]
    assert len(hosts) <= 1, words  # never two --host flags for vLLM to pick from
    return hosts[0] if hosts else None


def test_serve_and_exec_bind_loopback_unless_a_host_is_given(tmp_path):
    folder = _emit(tmp_path)
    bases = [["serve", "llama-3.1-8b", "--gpus", "1xH100"], ["exec", "--plan", str(folder)]]
    for base in bases:
        common = [*base, "--dry-run", "--no-metrics", "-q"]
        words, text = _dry(common)
        assert _host_of(words) == "127.0.0.1" and "no API key" not in text, base
        for given in (["--host", "0.0.0.0"], ["--", "--host", "0.0.0.0"],
                      ["--host", "10.1.2.3"]):
            argv = [*common, *given]
            words, text = _dry(argv, env={"VLLM_API_KEY": ""})
            assert _host_of(words) == given[-1], (base, given)
            assert "no API key" in text and "VLLM_API_KEY" in text, (base, given, text)
            words, text = _dry(argv, env={"VLLM_API_KEY": secrets.token_hex(8)})
            assert "no API key" not in text, (base, given)


def test_tune_trials_listen_on_loopback():
    from launcher.run.tune import _default_runner

    runner = _default_runner(["--model", "m", "--port", "1"], {})
    assert runner.vllm_args[runner.vllm_args.index("--host") + 1] == "127.0.0.1"
    mine = _default_runner(["--model", "m", "--port", "1", "--host", "::1"], {})
    assert _host_of(mine.vllm_args) == "::1"


# ---- readiness: ownership before anything is sent; /health without the key ---------------------


class _Recorder:
    """A loopback listener that records every byte sent to it and answers 200 to anything:
    the foreign listener that took the port first, or a stand-in vLLM."""

    def __init__(self) -> None:
        import socketserver

        self.requests: list[bytes] = []
        self.connections = 0
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer.connections += 1
                self.request.settimeout(2)
                data = b""
                with contextlib.suppress(OSError):
                    while b"\r\n\r\n" not in data:
                        chunk = self.request.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                if data:
                    outer.requests.append(data)
                    path = data.split(b" ", 2)[1] if data.count(b" ") >= 2 else b"/"
                    body = (b'{"data": [{"id": "m"}]}' if path.endswith(b"/v1/models")
                            else b"")
                    with contextlib.suppress(OSError):
                        self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: "
                                             + str(len(body)).encode()
                                             + b"\r\nConnection: close\r\n\r\n" + body)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def recorder():
    rec = _Recorder()
    yield rec
    rec.close()


def test_a_foreign_listener_on_our_port_is_sent_nothing(recorder, tmp_path, monkeypatch):
    """Our child never binds (it hangs); the port is held by another process, which must not
    receive a single request, least of all one carrying the key."""
    from launcher.run.runner import VllmRunner

    fake = REPO / "tests" / "fake_vllm.py"
    monkeypatch.setenv("VLAUNCH_VLLM_COMMAND", f"{sys.executable} {fake} serve")
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    key = secrets.token_hex(16)
    monkeypatch.setenv("VLLM_API_KEY", key)
    r = VllmRunner(["--model", "m", "--port", str(recorder.port)], log_path=tmp_path / "v.log",
                   poll_interval=0.1, grace_period=2)
    with r:
        r.start()
        out = r.wait_ready(timeout=3)
    assert not out.ready and r.foreign_listener
    assert recorder.requests == [], recorder.requests  # not /health, not /v1/models


def test_health_carries_no_key_and_v1_does(recorder):
    from launcher.run.endpoint import Endpoint

    key = secrets.token_hex(16)
    ep = Endpoint("127.0.0.1", recorder.port, "m", ["--api-key", key], {})
    assert ep.healthy() and ep.serves_model()
    ep.get("/metrics")
    sent = {r.split(b" ", 2)[1].decode(): r for r in recorder.requests}
    assert set(sent) == {"/health", "/v1/models", "/metrics"}
    for path, raw in sent.items():
        assert (key.encode() in raw) == path.startswith("/v1"), (path, raw)


# ---- vLLM's log files: new, private, never through a planted link --------------------------------


def test_a_planted_symlink_at_the_log_name_is_not_followed(tmp_path):
    from launcher.run.logpump import OutputLog

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    log = tmp_path / "logs" / "vllm-trial1.log"  # tune's names are predictable
    log.parent.mkdir()
    log.symlink_to(victim)
    out = OutputLog(log)
    out.open()
    out._write(b"secret engine output\n")
    out.close()
    assert victim.read_text() == "precious\n"
    assert out.path != log and out.path.parent == log.parent and not out.path.is_symlink()
    assert out.path.read_bytes() == b"secret engine output\n"
    assert stat.S_IMODE(out.path.stat().st_mode) & 0o077 == 0  # 0600 (less the umask)


def test_an_existing_log_is_neither_appended_to_nor_replaced(tmp_path):
    from launcher.run.logpump import OutputLog

    log = tmp_path / "vllm-trial1.log"
    log.write_text("someone else's file\n")
    outs = []
    for _ in range(3):
        out = OutputLog(log)
        out.open()
        out._write(b"mine\n")
        out.close()
        outs.append(out.path)
    assert log.read_text() == "someone else's file\n"
    assert len(set(outs)) == 3 and all(p.read_bytes() == b"mine\n" for p in outs)


def test_rotation_does_not_follow_a_link_planted_after_the_rename(tmp_path, monkeypatch):
    from launcher.run import logpump

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    log = tmp_path / "v.log"
    out = logpump.OutputLog(log, max_bytes=10)
    out.open()
    real_replace = os.replace

    def replace_then_plant(src, dst):
        real_replace(src, dst)
        os.symlink(victim, src)  # the attacker wins the race for the name

    monkeypatch.setattr(logpump.os, "replace", replace_then_plant)
    out._write(b"0123456789")
    out._write(b"more output\n")  # rotates: the new file must not be the victim
    assert victim.read_text() == "precious\n"
    assert out.write_errors >= 1


def test_a_serve_results_attempts_keep_no_key():
    """`serve --format json` prints every attempt's arguments: they are kept redacted."""
    from launcher.run.serve import Attempt

    key = secrets.token_hex(12)
    a = Attempt(1, ["--model", "m", "--api-key", key, "--port", "1"], "serving")
    assert key not in json.dumps(a.args) and a.args[3] == REDACTED
    assert a.args[:2] == ["--model", "m"]
