"""Imports go one way: server -> scheduler -> {spec_phases, kv_cache} -> kernels
(spec_phases may read kv_cache). Every package folder is installed as specserve.<folder>.

Edges that skip a layer are allowed module by module (NARROW), each for one reason:
- server -> spec_phases.sampling_params: the typed request parameters (and ParamError) are the step
  contract's, shared by every layer; the server builds them from the JSON body.
- server, loadtests (a tool) -> spec_phases.paths: where the embedded model and the cache
  directory are (the tokenizer files sit beside the model; peers are given the same file).
- server -> kv_cache.compress.registry: the compressor names, for the CLI's choices.
- server -> spec_phases.tokenizer: one tokenizer loader; the worker's grammar masks (structured
  output) must see the same tokens the server encodes and decodes.
Everything else goes through the layer below."""
import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "server": {"server", "scheduler"},
    "scheduler": {"scheduler", "spec_phases", "kv_cache"},
    "spec_phases": {"spec_phases", "kv_cache", "kernels"},
    "kv_cache": {"kv_cache", "kernels"},
    "kernels": {"kernels"},
}
NARROW = {
    "server": {"spec_phases.sampling_params", "spec_phases.paths", "kv_cache.compress.registry",
               "spec_phases.tokenizer"},
}
# Tool folders of the checkout, never installed with the server (run from the repository root as
# `python -m loadtests.compare`): the product modules each may import. loadtests speaks HTTP (and
# cuts prompts to token counts with the served model's tokenizer).
TOOLS = {"loadtests": {"spec_phases.paths", "spec_phases.tokenizer"}}


def imported_layers(path: Path) -> set[tuple[str, int]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module.startswith("specserve.") and all(a.name.islower() for a in node.names):
                names = [f"{node.module}.{a.name}" for a in node.names]   # may be submodules
        for name in names:
            parts = name.split(".")
            if parts[0] == "specserve" and len(parts) > 1:
                found.add((".".join(parts[1:]), node.lineno))
            elif parts[0] in ALLOWED:
                found.add((parts[0] + " (bare import: use specserve.*)", node.lineno))
    return found


def test_imports_go_one_way():
    bad = []
    for layer, allowed in ALLOWED.items():
        for path in (ROOT / layer).rglob("*.py"):
            for target, line in imported_layers(path):
                narrow = NARROW.get(layer, ())
                if not (target.split(".")[0] in allowed or target in narrow
                        or target.rsplit(".", 1)[0] in narrow):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    for tool, narrow in TOOLS.items():
        for path in (ROOT / tool).rglob("*.py"):
            bad += [f"{path.relative_to(ROOT)}:{line} imports {target}"
                    for target, line in imported_layers(path)
                    if not (target in narrow or target.rsplit(".", 1)[0] in narrow)]
    assert not bad, "\n".join(bad)


def test_every_package_folder_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(config["packages"])
    for layer in ALLOWED:
        for init in (ROOT / layer).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            assert ("specserve." + ".".join(rel.parts)
                    in declared), f"{rel} missing from pyproject packages"
    installed = set(config["package-dir"].values()) | {name.split(".")[1] for name in declared}
    assert installed == set(ALLOWED), f"only the product is installed: {installed ^ set(ALLOWED)}"
