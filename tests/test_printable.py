"""Nothing raw reaches the terminal (issue 31, M4): escape sequences in a Hub model_type, a
model folder's name or a vLLM log's model name are stripped once, at the command line's edge
(launcher/printable.py), and from the termination log.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.printable import one_line, printable

ROOT = Path(__file__).resolve().parent.parent
# What a terminal obeys: ESC and the C0/C1 controls (but tab and newline), DEL, bidi controls.
OBEYED = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
ATTACK = "\x1b]0;pwned\x07\x1b[2J\x1b[H\x1b[1;32mFITS\x1b[0m\r\u202e\x9b2J\x00"
CONFIG = dict(model_type="llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, intermediate_size=512, vocab_size=1000, num_hidden_layers=2,
              max_position_embeddings=2048, torch_dtype="bfloat16")


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _subsequence(small: str, big: str) -> bool:
    it = iter(big)
    return all(c in it for c in small)


def test_printable_keeps_every_printable_character_and_no_control() -> None:
    """Property over 2,000 random strings from an alphabet heavy in escapes: the result has no
    character a terminal obeys, keeps every printable character, tab and newline in order, and
    is unchanged by a second pass."""
    rng = random.Random(31)
    alphabet = "ab [];0123456789mHJ?\x1b\x07\x9b\x9d\x00\r\n\t\x7f\u202e\u2066é中"
    for _ in range(2000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        out = printable(s)
        assert not OBEYED.search(out), repr(s)
        lines = s.replace("\r\n", "\n").replace("\r", "\n")  # nothing overwritten
        assert _subsequence(out, lines) and printable(out) == out
        kept = "".join(c for c in lines if c.isprintable() or c in "\n\t")
        assert _subsequence(out, kept) and out.count("\n") == lines.count("\n")
        assert "\n" not in one_line(s) and not OBEYED.search(one_line(s))
    assert printable("plain text\n\tindented") == "plain text\n\tindented"
    assert printable(ATTACK) == "]0;pwnedFITS\n"


def _clean(output: str) -> None:
    assert not OBEYED.search(output), repr(output[:400])


def test_a_model_type_carrying_escapes_never_reaches_the_terminal(tmp_path: Path) -> None:
    """The attack: a config's model_type retitled the terminal, cleared it and printed a fake
    FITS. It is refused with one line, which shows no escape."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(CONFIG, model_type=ATTACK)))
    r = CliRunner().invoke(cli, ["plan", str(tmp_path / "m"), "--gpus", "1xH100"])
    assert r.exit_code == 2, r.output
    _clean(r.output)
    assert "model_type" in r.stderr


def test_every_field_printed_is_stripped_at_the_edge(tmp_path: Path) -> None:
    """A field no check refuses (a local folder's name) is printed by the text plan: the edge
    strips what it carries, and the JSON output escapes it as JSON does."""
    folder = tmp_path / f"evil{ATTACK.replace(chr(0), '')}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    r = CliRunner().invoke(cli, ["plan", str(folder), "--gpus", "1xH100"])
    assert r.exit_code == 0, r.output
    assert "evil]0;pwnedFITS" in r.output
    _clean(r.output)
    r = CliRunner().invoke(cli, ["plan", str(folder), "--gpus", "1xH100", "--format", "json"])
    assert r.exit_code == 0
    _clean(r.output)
    assert json.loads(r.stdout)["model"]["name"].startswith("evil\x1b]0;")


def test_the_doctor_run_line_prints_no_escape_from_the_log(tmp_path: Path) -> None:
    log = (ROOT / "tests/fixtures/doctor/kv_short_v032_cpu.log").read_text()
    hostile = log.replace("'/models/tiny'", repr("/models/tiny" + ATTACK.replace("\r", "")))
    assert hostile != log
    (tmp_path / "vllm.log").write_text(hostile)
    r = CliRunner().invoke(cli, ["doctor", str(tmp_path / "vllm.log")])
    assert r.exit_code == 1, r.output
    assert "run: vlaunch serve" in r.output
    _clean(r.output)


def test_the_termination_log_holds_no_escape(tmp_path: Path) -> None:
    from launcher.run.emit import write_termination_message

    p = tmp_path / "termination-log"
    p.write_text("")
    assert write_termination_message(f"plan for {ATTACK}\nline two", p)
    text = p.read_text()
    _clean(text)
    assert text == "plan for ]0;pwnedFITS\n\nline two"
