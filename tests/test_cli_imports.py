"""`ridgeline analyze` imports what reading and analysing need, and nothing of the live agent
(issue 21.3: zmq, the CUPTI server and the subscriber cost it some 0.3 s of imports).

Each case runs in a fresh interpreter: this test process has imported everything already.
"""
import json
import subprocess
import sys

import pytest

ALEXNET = "nvidia-training/hta_a100_alexnet_benchmark.json.gz"
# modules of the live agent that a trace analysis has no use for
AGENT_ONLY = ("zmq", "ridgeline.agent.subscriber", "ridgeline.agent.publisher", "ridgeline.agent.daemon",
              "ridgeline.probes.cupti.server", "ridgeline.agent.commands.top", "ridgeline.agent.commands.run")

# the command's exit code and the modules loaded, written to the file argv[1]
PROBE = """
import json, sys
from ridgeline.agent.cli import main
rc = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump({"rc": rc, "modules": sorted(sys.modules)}, f)
"""


def _imported(tmp_path, *argv: str) -> dict:
    report = tmp_path / "modules.json"
    p = subprocess.run([sys.executable, "-c", PROBE, str(report), *argv], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(report.read_text())
    got["out"] = p.stdout
    return got


def test_analyze_imports_no_agent_module(trace_path, tmp_path):
    got = _imported(tmp_path, "analyze", "--json", str(trace_path(ALEXNET)))
    assert got["rc"] == 0
    assert got["out"].startswith("{")
    loaded = set(got["modules"])
    assert not loaded & set(AGENT_ONLY), sorted(loaded & set(AGENT_ONLY))
    # the reader itself was loaded: the check above is not vacuous
    assert "ridgeline.probes.kineto" in loaded


def test_analyze_bad_input_imports_no_agent_module(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    got = _imported(tmp_path, "analyze", str(bad))
    assert got["rc"] == 2
    assert "zmq" not in got["modules"]


@pytest.mark.parametrize("argv", [["--help"], ["no-such-command"]])
def test_full_parser_still_lists_every_command(argv):
    p = subprocess.run([sys.executable, "-m", "ridgeline", *argv], capture_output=True, text=True, timeout=120,
                       cwd="/")
    text = p.stdout + p.stderr
    for name in ("analyze", "agent", "top", "inject-unit"):
        assert name in text


def test_the_command_list_names_every_command_module():
    """Registration is explicit (agent.commands.COMMANDS): a module left off the list
    would be a command nobody can run."""
    import pkgutil

    from ridgeline.agent import commands
    names = {m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_")}
    assert set(commands.COMMANDS) == names and len(commands.COMMANDS) == len(names)


def test_every_command_module_registers_the_command_it_is_named_for():
    """main() imports only the module named for argv[0]: a module registering another
    name would leave that command unreachable."""
    import pkgutil

    from ridgeline.agent import cli, commands
    names = [m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_")]
    assert "analyze" in names
    for name in names:
        parser = cli.build_parser(only=name)
        sub = next(a for a in parser._actions if a.dest == "command")
        assert list(sub.choices) == [name.replace("_", "-")], name


def test_the_daemon_imports_no_optional_extra():
    """The agent host installs ridgeline alone: the daemon's modules (and every probe
    the registry builds) import neither rich nor matplotlib (the terminal and plot
    extras) nor httpx (issue 19)."""
    code = ("import sys\n"
            "from ridgeline.agent import config, daemon, prometheus, registry\n"
            "cfg = config.defaults()\n"
            "for name, step in registry.STEPS.items():\n"
            "    step.factory(cfg).stop()\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('rich', 'matplotlib', 'httpx'))))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == []
    # not vacuous: the same probe sees the extras where they are imported
    code2 = code.replace("import sys\n", "import sys\nimport rich.table\n", 1)
    p = subprocess.run([sys.executable, "-c", code2], capture_output=True, text=True, timeout=120, cwd="/")
    assert "rich.table" in p.stdout.split()
