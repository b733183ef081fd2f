"""The package layout docs/design.md draws: packages import downwards only, and a family's code stays in its package."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "nanotron"

# Each line may import only from the lines below it (and from itself); docs/design.md draws the same order.
LAYERS = [
    {"cli", "__main__"},
    {"trainer", "plot", "planning"},
    {"features"},
    {"training"},
    {"generation", "memory"},
    {"checkpoint"},
    {"models"},
    {"optim", "logging"},
    {"parallel"},
    {"nn", "data"},
    {"config", "layout", "pipeline_schedules", "errors", "files", "random", "preemption", "metrics", "trackers",
     "divergence"},
]


def _imports() -> dict[str, set[str]]:
    """Top-level unit (package or module of nanotron) → the other units it imports, anywhere in its files (imports
    for type annotations only, under ``if TYPE_CHECKING:``, excepted: they never run)."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        unit = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        tree = ast.parse(path.read_text(), str(path))
        annotation_only = {id(node) for block in ast.walk(tree)
                           if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
                           for statement in block.body for node in ast.walk(statement)}
        for node in ast.walk(tree):
            if id(node) in annotation_only:
                continue
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                parts = name.split(".")
                if parts[0] == "nanotron" and len(parts) > 1 and parts[1] != unit:
                    edges.setdefault(unit, set()).add(parts[1])
    return edges


def test_packages_import_downwards_only():
    layer_of = {unit: index for index, layer in enumerate(LAYERS) for unit in layer}
    edges = _imports()
    units = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in PACKAGE.rglob("*.py")} - {"__init__"}
    assert units <= set(layer_of), f"place {sorted(units - set(layer_of))} in LAYERS"
    upward = sorted(f"{unit} -> {other}" for unit, others in edges.items() for other in others
                    if layer_of[other] < layer_of[unit])
    assert not upward, upward

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(other == goal or (other not in seen and reaches(other, goal, seen | {other}))
                   for other in edges.get(start, ()))

    assert not [unit for unit in edges if reaches(unit, unit, {unit})], "packages of one line import each other"


@pytest.mark.slow
def test_no_family_is_named_outside_its_package_and_the_registry():
    """Dispatch on families happens through the registry and the family's config: code outside ``models/<family>/``,
    the family's config module and the table of config classes by marker (``config/model.py``, exported by
    ``config/__init__.py``) never names a family's classes; the rules between config sections and the loader ask the
    config what the family supports."""
    family_names = ("LlamaConfig", "LlaMoEConfig", "MambaConfig", "Qwen2Config", "Qwen2MoEConfig", "Qwen3Config",
                    "Qwen3MoEConfig", "LlamaForCausalLM", "LlaMoEForCausalLM", "MambaForCausalLM", "Qwen2ForCausalLM",
                    "Qwen3ForCausalLM", "MoEFeedForward", "MambaMixer", "DeepseekV3Config", "DeepseekV3ForCausalLM")
    allowed = {PACKAGE / "models" / family for family in ("llama", "moe", "mamba", "qwen2", "qwen3", "deepseek_v3")}
    allowed_files = {PACKAGE / "config" / f"{name}.py" for name in ("llama", "moe", "mamba", "qwen2", "qwen2_moe",
                                                                     "qwen3", "deepseek_v3", "model", "__init__")}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path in allowed_files or any(folder in path.parents for folder in allowed):
            continue
        tree = ast.parse(path.read_text(), str(path))
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        used |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        offenders += [f"{path.relative_to(PACKAGE)}: {name}" for name in family_names if name in used]
    assert not offenders, offenders


@pytest.mark.slow
def test_no_test_file_imports_another():
    """Shared test code lives in the ``support`` package: a test file imported by another runs its module code
    (fixtures, constants) twice under two names and couples the files."""
    imported = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            imported += [(path.name, name) for name in names if name.startswith("test_")]
    assert not imported, imported


@pytest.mark.slow
def test_axes_and_groups_are_named_by_their_enums_outside_the_layout():
    """The grid's axes and groups are looked up as ``Axis``/``Group`` members (``pc.size(Axis.CP)``,
    ``pc.group(Group.TP)``), never by their names as strings (``pc.size("cp")``, ``coords["pp"]``): only
    ``layout.py`` spells them, so that every use of an axis can be found from its enum."""
    from nanotron.layout import Axis, Group

    names = {member.value for member in (*Axis, *Group)} | {"pipeline_ends"}
    lookups = {"size", "coord", "group", "members"}

    def spelled(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "layout.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            by_call = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                       and node.func.attr in lookups and any(map(spelled, node.args)))
            by_key = isinstance(node, ast.Subscript) and spelled(node.slice)
            if by_call or by_key:
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, offenders
