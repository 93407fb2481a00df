import subprocess
import sys

from ridgeline.agent import cli


def test_help_lists_commands(capsys):
    code = cli.main([])
    assert code == 2


def test_unknown_command_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "ridgeline", "no-such-command"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
