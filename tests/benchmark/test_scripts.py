"""The developer benchmarks (benchmarks/) run as modules from the repository root, as the Makefile
runs them: every script's `--help`, in a process of its own, so a library change that breaks a
script's imports or arguments shows here instead of on the next benchmark run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(".".join(path.relative_to(ROOT).with_suffix("").parts)
                 for path in (ROOT / "benchmarks").rglob("*.py") if 'if __name__ == "__main__":' in path.read_text())
# Each module's `--help`, one interpreter for all of them (torch imported once).
HELP_OF_EACH = """
import runpy, sys
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    try:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        if exit.code not in (0, None):
            raise SystemExit(f"{name} --help exited {exit.code}")
    else:
        raise SystemExit(f"{name} --help did not exit")
    print(f"ok {name}", flush=True)
"""


def test_every_script_runs_as_a_module():
    assert {"benchmarks.step_profile", "benchmarks.peers.run", "benchmarks.peers.native",
            "benchmarks.lm_eval.smoke"} <= set(SCRIPTS)
    done = subprocess.run([sys.executable, "-c", HELP_OF_EACH, *SCRIPTS], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert [line.removeprefix("ok ") for line in done.stdout.splitlines() if line.startswith("ok ")] == SCRIPTS


def test_no_script_patches_the_import_path():
    """Every script imports its neighbours as `benchmarks.<name>`: none edits sys.path."""
    patching = [str(path.relative_to(ROOT)) for path in (ROOT / "benchmarks").rglob("*.py")
                if "sys.path" in path.read_text()]
    assert not patching
