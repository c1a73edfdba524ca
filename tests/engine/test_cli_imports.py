"""What `blockserve generate` / `serve` import before the model loads: the CLI's parser alone must
not import torch or transformers (the `bench` subcommands' modules do, seconds of every start), and
`blockserve bench` still lists its subcommands."""

from __future__ import annotations

import subprocess
import sys


def test_parser_for_serve_imports_neither_torch_nor_transformers():
    code = ("import sys; from blockserve.cli import build_parser; "
            "build_parser(bench=False).parse_args(['serve', '--port', '1']); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bench_lists_its_subcommands(capsys):
    from blockserve.cli import main

    try:
        main(["bench", "--help"])
    except SystemExit as exit:
        assert exit.code == 0
    help_text = capsys.readouterr().out
    assert all(name in help_text for name in ("throughput", "latency", "serve", "gpu-check"))
