"""The OpenMP wait policy the `blockserve` command starts with (blockserve/thread_policy.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from blockserve.thread_policy import OFFLINE_DEFAULTS, SERVER_DEFAULTS, apply_defaults


@pytest.mark.parametrize("command, expected", [("serve", {"OMP_WAIT_POLICY": "PASSIVE"}),
                                               ("generate", {"GOMP_SPINCOUNT": "100000"}),
                                               ("bench", {"GOMP_SPINCOUNT": "100000"}), (None, OFFLINE_DEFAULTS)])
def test_the_commands_policy_is_set_when_the_caller_chose_none(command, expected):
    environ = {"PATH": "/bin"}
    assert apply_defaults(command, environ) == expected
    assert environ == {"PATH": "/bin", **expected}
    assert SERVER_DEFAULTS != OFFLINE_DEFAULTS


def test_a_policy_the_caller_chose_is_kept():
    for choice in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}):
        for command in ("serve", "generate"):
            environ = dict(choice)
            assert apply_defaults(command, environ) == {}
            assert environ == choice


@pytest.mark.parametrize("argv, variable, value", [("['-q', 'serve']", "OMP_WAIT_POLICY", "PASSIVE"),
                                                   ("['generate']", "GOMP_SPINCOUNT", "100000")])
def test_the_cli_sets_it_before_torch_loads(argv, variable, value):
    """libgomp reads its environment when torch loads: importing the CLI must not load torch, and
    main() applies the command's policy before any command runs."""
    code = ("import sys, os, blockserve.cli as cli; assert 'torch' not in sys.modules; "
            "[os.environ.pop(k, None) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')]; cli.build_parser = lambda: (_ for _ in ()).throw(SystemExit(0));\n"
            f"try:\n    cli.main({argv})\nexcept SystemExit:\n    pass\n"
            f"assert os.environ['{variable}'] == '{value}' and 'torch' not in sys.modules")
    env = {"PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
