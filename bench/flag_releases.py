"""Which vLLM releases have each flag of the flag table, read from each release's sdist.

Why: the flag table (launcher/inputs/vllm_flags.py) records the first (and, for a removed flag,
the last) release with each flag; the numbers come from the sdists, the way the feature gates
of profiles/capabilities.yaml were read, and this script is how to read them again.

How: `pip download --no-deps --no-binary :all: --no-clean vllm==X` fetches and unpacks the
sdist (building it fails, the unpacked tree stays); the serving parser's files are searched
for each flag: an `add_argument("--name"` literal in engine/arg_utils.py,
entrypoints/{openai,launchers}/cli_args.py or entrypoints/cli/serve.py, or a field `dest:` of a
FrontendArgs dataclass in cli_args.py (vLLM generates those flags from the fields). The tree is
deleted after each release. Writes tests/fixtures/vllm_flag_releases.csv (release, flags).

    PYTHONPATH=$PWD .venv/bin/python bench/flag_releases.py 0.6.0 0.7.3 ... [--site-packages]

`--site-packages DIR` reads an installed vLLM instead of downloading (a check of the method
against the parser itself: tests/test_vllm_flags.py).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from launcher.inputs import vllm_flags as F

FILES = ("vllm/engine/arg_utils.py", "vllm/entrypoints/openai/cli_args.py",
         "vllm/entrypoints/launchers/cli_args.py", "vllm/entrypoints/cli/serve.py")
OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm_flag_releases.csv"


def flags_in(root: Path) -> set[str]:
    """The table's dests that the vLLM source tree at `root` (holding vllm/) defines."""
    texts = {}
    for rel in FILES:
        p = root / rel
        if p.is_file():
            texts[rel] = p.read_text(encoding="utf-8", errors="replace")
    found: set[str] = set()
    for f in F.flags():
        literal = re.compile(r"""add_argument\(\s*["']""" + re.escape(f.name) + "[\"']")
        field = re.compile(r"^    " + re.escape(f.dest) + r"\s*:", re.M)
        for rel, text in texts.items():
            generated = rel.endswith("cli_args.py") and "FrontendArgs" in text
            if literal.search(text) or (generated and field.search(text)):
                found.add(f.dest)
    return found


def download(release: str, tmp: Path) -> Path | None:
    """The unpacked sdist of `release`, or None when PyPI has none."""
    env = {**os.environ, "TMPDIR": str(tmp), "VLLM_TARGET_DEVICE": "empty"}
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "--no-build-isolation", "--no-clean", "-q", "-d", str(tmp / "dl"),
                    f"vllm=={release}"], env=env, capture_output=True, timeout=600)
    for p in tmp.glob("pip-download-*/*"):
        if (p / "vllm").is_dir():
            return p
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("releases", nargs="*")
    ap.add_argument("--site-packages")
    ns = ap.parse_args()
    if ns.site_packages:
        print(" ".join(sorted(flags_in(Path(ns.site_packages)))))
        return
    rows = []
    for release in ns.releases:
        tmp = Path(tempfile.mkdtemp(prefix="flagrel-"))
        try:
            root = download(release, tmp)
            if root is None:
                print(f"{release}: no sdist", flush=True)
                continue
            have = flags_in(root)
            rows.append((release, " ".join(sorted(have))))
            print(f"{release}: {len(have)} flags", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    with OUT.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["release", "flags"])
        w.writerows(rows)


if __name__ == "__main__":
    main()
