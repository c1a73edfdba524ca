"""The OpenMP wait policy the `blockserve` command starts with (blockserve/thread_policy.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from blockserve.thread_policy import DEFAULTS, apply_defaults


def test_the_policy_is_set_when_the_caller_chose_none():
    environ = {"PATH": "/bin"}
    assert apply_defaults(environ) == DEFAULTS == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert environ == {"PATH": "/bin", **DEFAULTS}


def test_a_policy_the_caller_chose_is_kept():
    for choice in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}, {"KMP_BLOCKTIME": "0"}):
        environ = dict(choice)
        assert apply_defaults(environ) == {}
        assert environ == choice


@pytest.mark.parametrize("argv", ["['-q', 'serve']", "['generate']"])
def test_the_cli_sets_it_before_torch_loads(argv):
    """libgomp reads its environment when torch loads: importing the CLI must not load torch, and
    main() applies the policy before any command runs."""
    code = ("import sys, os, blockserve.cli as cli; assert 'torch' not in sys.modules; "
            "[os.environ.pop(k, None) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')]; cli.build_parser = lambda *args, **options: (_ for _ in ()).throw(SystemExit(0));\n"
            f"try:\n    cli.main({argv})\nexcept SystemExit:\n    pass\n"
            "assert os.environ['OMP_WAIT_POLICY'] == 'PASSIVE' and 'torch' not in sys.modules")
    env = {"PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
