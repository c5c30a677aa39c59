"""The README's test command is what CI runs (its last line; the lines before it only install the
tools the deploy tests need), and the serve command names the real CLI."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", (ROOT / "README.md").read_text())


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    serve, test = readme_commands()
    assert "specserve serve" in serve and "127.0.0.1" in serve and "--port 8000" in serve
    assert "pytest" in test
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines[-1] == test                      # CI ends with exactly the README's command
    assert sum("pytest" in line for line in ci_lines) == 1   # and runs tests nowhere else
