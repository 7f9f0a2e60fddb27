"""The package's rooms import only downward: config → planning → worker / driver → sweep → API.

A worker may run on another machine than the driver and shares with it only the task it
was sent and the run's storage, so worker code never imports driver code; built-in models
and datasets import neither. Every import counts, those inside functions too.
"""

from __future__ import annotations

import ast

import pytest
from paths import ROOT

PACKAGE = ROOT / "raytrain_app"

# Room -> the rooms it may import from (besides itself).
BASE = {"base", "storage"}
ALLOWED = {
    "base": set(),  # errors, protocol, logging
    "storage": {"base"},  # the run's storage: local paths and object-store URIs
    "config": BASE,
    "workloads": BASE | {"config"},  # built-in data and models, factory loading
    "planning": BASE | {"config"},
    "tracking": BASE | {"config"},
    "checkpoint": BASE | {"config", "workloads"},
    "worker": BASE | {"config", "workloads", "planning", "tracking", "checkpoint"},
    "driver": BASE | {"config", "workloads", "planning", "tracking", "checkpoint", "worker"},
    "sweep": BASE
    | {"config", "workloads", "planning", "tracking", "checkpoint", "worker", "driver"},
    "api": {"*"},  # the package's __init__, cli, jobs, predict
    "testing": {"*"},  # helpers for tests and benchmarks; nothing in the product imports it
}
TOP_LEVEL_ROOMS = {
    "errors": "base",
    "protocol": "base",
    "logging_setup": "base",
    "startup_gc": "base",  # the collector held off while a process starts a run
    "workloads": "workloads",
    "factory_targets": "workloads",  # the factories' names, found without importing them
    "__init__": "api",
    "run_clock": "api",  # when a run began: the command's first import
    "cli": "api",
    "cli_flags": "api",
    "jobs": "api",
    "predict": "api",
}
FOLDER_ROOMS = {"data": "workloads", "models": "workloads"}


def room_of(module: str) -> str:
    """The room of a dotted module name inside raytrain_app (``raytrain_app.worker.loop``)."""
    parts = module.split(".")[1:] or ["__init__"]
    head = parts[0]
    if len(parts) == 1 and head in TOP_LEVEL_ROOMS:
        return TOP_LEVEL_ROOMS[head]
    if head in FOLDER_ROOMS:
        return FOLDER_ROOMS[head]
    if head in ALLOWED:
        return head
    raise AssertionError(f"raytrain_app.{'.'.join(parts)} belongs to no room: add it here")


def module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path) -> list[tuple[int, str]]:
    """Every raytrain_app module ``path`` imports, with its line number."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "raytrain_app":  # from raytrain_app import jobs
                found += [(node.lineno, f"raytrain_app.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.split(".")[0] == "raytrain_app"]


MODULES = sorted(PACKAGE.rglob("*.py"))


def violations(path, importer: str) -> list[str]:
    """The imports of ``path`` (the module ``importer``) that go to a room not allowed."""
    room = room_of(importer)
    allowed = ALLOWED[room]
    return [
        f"line {line}: {importer} ({room}) imports {target} ({room_of(target)})"
        for line, target in imported_modules(path)
        if "*" not in allowed and room_of(target) not in allowed | {room}
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_import_goes_to_an_allowed_room(path):
    assert violations(path, module_name(path)) == []


def test_the_check_catches_a_worker_importing_the_driver_inside_a_function(tmp_path):
    module = tmp_path / "fake.py"
    module.write_text(
        "from raytrain_app.config import RaytrainConfig\n"
        "def f():\n"
        "    from raytrain_app.driver import training\n"
    )
    assert violations(module, "raytrain_app.worker.fake") == [
        "line 3: raytrain_app.worker.fake (worker) imports raytrain_app.driver (driver)"
    ]


def import_graph(paths, root=ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, every import counted (inside functions
    and ``TYPE_CHECKING`` too); ``from raytrain_app.data import windows`` imports the module
    ``raytrain_app.data.windows``, not the package. ``root``: the folder holding the package."""
    dotted = {path: ".".join(path.relative_to(root).with_suffix("").parts) for path in paths}
    dotted = {path: name.removesuffix(".__init__") for path, name in dotted.items()}
    names = set(dotted.values())
    graph = {}
    for path, name in dotted.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    inner = f"{node.module}.{alias.name}"
                    targets.add(inner if inner in names else node.module)
        graph[name] = {t for t in targets & names if t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another, directly or through others (the
    strongly connected components of more than one module, by Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_no_modules_import_each_other():
    """A circle makes the import order matter (a name read before its module finished
    loading) and leaves no one module owning what both need."""
    assert import_cycles(import_graph(MODULES)) == []


def test_the_cycle_check_finds_a_circle_through_a_third_module_and_a_function(tmp_path):
    sources = {
        "a": "from raytrain_app.pkg import b\n",
        "b": "def f():\n    import raytrain_app.pkg.c\n",
        "c": "from raytrain_app.pkg.a import thing\n",
        "d": "from raytrain_app.pkg import a\n",
    }
    package = tmp_path / "raytrain_app" / "pkg"
    package.mkdir(parents=True)
    for name, text in sources.items():
        (package / f"{name}.py").write_text(text)
    graph = import_graph(sorted(package.glob("*.py")), root=tmp_path)
    assert import_cycles(graph) == [[f"raytrain_app.pkg.{name}" for name in "abc"]]


def test_nothing_in_the_product_imports_the_testing_helpers():
    users = [
        module_name(path)
        for path in MODULES
        if room_of(module_name(path)) != "testing"
        and any(room_of(t) == "testing" for _, t in imported_modules(path))
    ]
    assert users == []


def test_the_job_client_commands_do_not_import_torch():
    """`raytrain submit` and `raytrain jobs` only talk to a job server: importing torch
    (1.5 s) for them would slow every status poll a script or a test makes."""
    import subprocess
    import sys

    code = (
        "import sys, raytrain_app, raytrain_app.cli, raytrain_app.jobs; "
        "print(sorted(m for m in ('torch', 'ray.train') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_bad_config_is_refused_before_torch_or_ray_train_is_imported():
    """A typo in a key is answered in a fraction of a second, not after 2 s of imports."""
    import subprocess
    import sys

    code = (
        "import sys; from raytrain_app.cli import main; "
        "codes = [main([c, '--set', 'train.lrr=1']) for c in ('train', 'plan', 'tune')]; "
        "print(codes, sorted(m for m in ('torch', 'ray.train') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[2, 2, 2] []", result.stdout + result.stderr


def test_only_an_fsdp_run_imports_fsdp_and_distributed_checkpoint():
    """FSDP and torch.distributed.checkpoint (with DTensor) take some 0.7 s to import, paid
    by every worker and driver process at start if the training path imported them."""
    import subprocess
    import sys

    heavy = ("torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.tensor")
    code = (
        "import sys, raytrain_app.worker.loop, raytrain_app.driver.trainer, raytrain_app.cli; "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
