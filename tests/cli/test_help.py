from __future__ import annotations

import subprocess
import sys


def test_help_lists_commands_without_importing_torch():
    code = (
        "import sys, contextlib, io\n"
        "from skylift.cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        "print('torch' in sys.modules)\n"
        "print(out.getvalue())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("False")
    for command in ("run", "launch", "check"):
        assert command in result.stdout


def test_check_prints_the_resolved_config(cli_here):
    result = cli_here("check", "examples/quickstart.yaml", "--set", "optim.lr=0.5")
    assert result.returncode == 0
    assert "lr: 0.5" in result.stdout
    assert "global_batch_size: 64" in result.stdout
