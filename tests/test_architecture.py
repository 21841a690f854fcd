"""The tree is the architecture (docs/design.md#layers): every import between the
project's modules, read from the source (imports inside functions too), runs one way.

    commands -> tracking -> workspace -> stages -> training -> models / ops

tracking is a layer of the chain: only commands use it, and it uses the workspace (its lock,
the scores) and stages.base (its stand-in tracker). spec, cluster and data sit beside the chain:
the layers above models and ops may use them, and they use neither commands nor tracking;
data, models and ops use none of the layers above them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {
    "commands": 6, "tracking": 5, "workspace": 4, "stages": 3, "training": 2, "models": 1, "ops": 1
}  # fmt: skip
LEAVES = {"data", "models", "ops"}  # import only each other, errors and fsutil
BESIDE = {"spec", "cluster", "data"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    files = [*ROOT.glob("pipeline/**/*.py"), *ROOT.glob("stages/**/*.py")]
    return {module_name(f): f for f in files}


def imports(path: Path, package: str, known: set[str]) -> set[str]:
    """The project modules `path` imports (`from pipeline.x import y` counts pipeline.x.y
    when that is a module, else pipeline.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def graph() -> dict[str, set[str]]:
    mods = project_modules()
    known = set(mods)
    return {
        name: imports(path, name if path.name == "__init__.py" else name.rpartition(".")[0], known)
        - {name}
        for name, path in mods.items()
    }


def layer(module: str) -> str:
    """pipeline.training.trainer -> training; stages.train -> stages; pipeline.errors -> ''."""
    parts = module.split(".")
    if parts[0] == "stages":
        return "stages"
    return (
        parts[1]
        if len(parts) > 2 or (len(parts) == 2 and (ROOT / "pipeline" / parts[1]).is_dir())
        else ""
    )


def test_no_import_runs_in_a_circle():
    g = graph()
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert cycles == []


def test_a_lower_layer_never_imports_a_higher_one():
    wrong = []
    for module, targets in graph().items():
        here = layer(module)
        for target in targets:
            there = layer(target)
            if here in RANK and there in RANK and RANK[there] > RANK[here]:
                wrong.append(f"{module} ({here}) imports {target} ({there})")
            if here in BESIDE and there in ("commands", "tracking"):
                wrong.append(f"{module} ({here}) imports {target} ({there})")
            if here in LEAVES and there not in LEAVES | {""}:
                wrong.append(f"{module} ({here}) imports {target} ({there})")
    assert wrong == []


def test_the_layer_rule_sees_a_wrong_import():
    """The checks read what they should: a known import is found, with its layer."""
    g = graph()
    assert "pipeline.workspace.runner" in g["pipeline.commands.launched"]
    assert "pipeline.workspace.lock" in g["pipeline.tracking.tracker"]  # tracking above it
    assert layer("pipeline.tracking.tracker") == "tracking"
    assert layer("pipeline.workspace.runner") == "workspace" and layer("pipeline.errors") == ""
    assert layer("stages.train") == "stages" and layer("pipeline.data") == "data"
    assert (
        "stages" in g["pipeline.workspace.runner"]
        and "pipeline.training.trainer" in g["stages.training"]
    )


def test_only_the_engine_module_reaches_into_deepspeed():
    """pipeline/training/engine.py is the one seam to DeepSpeed: no other module of pipeline/
    or stages/ imports deepspeed or reads its engine's internals (its optimizer wrapper, the
    wrapper's flat groups and partitions, its private attributes), so that a DeepSpeed
    upgrade is checked in one file (`allowed` lists the two exceptions). Trainer is built
    from named builders around that seam: its __init__ stays under 40 lines."""
    import inspect
    import re

    from pipeline.training.trainer import Trainer

    wrapper_attr = re.compile(
        r"(bit16|bf16|fp16|fp32)_\w*groups|groups_flat|^(basic_optimizer|real_dp_process_group|"
        r"round_robin_\w+|ds_tensor|ds_numel|enable_backward_allreduce|cpu_offload|"
        r"offload_optimizer|sub_group_process_groups)$"
    )

    def reaches_in(source: str) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "deepspeed"}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                if (node.module or "").split(".")[0] == "deepspeed":
                    found.add(node.module or "")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if wrapper_attr.search(node.value):  # getattr(wrapper, "bf16_groups_flat")
                    found.add(node.value)
            elif isinstance(node, ast.Attribute):
                value = node.value
                owner = value.attr if isinstance(value, ast.Attribute) else ""
                owner = value.id if isinstance(value, ast.Name) else owner
                if wrapper_attr.search(node.attr) or owner == "wrapper":
                    found.add(f"{owner}.{node.attr}")
                elif owner.endswith("engine") and (
                    node.attr == "optimizer" or node.attr.startswith("_")
                ):
                    found.add(f"{owner}.{node.attr}")
        return found

    # the scan sees each kind of access, in the seam itself
    seam = reaches_in((ROOT / "pipeline/training/engine.py").read_text())
    assert {"deepspeed", "engine.optimizer", "bf16_groups_flat", "wrapper.fp16_groups"} <= seam
    assert reaches_in("self.engine._x\nw.fp32_groups_flat_partition\nengine.module") == {
        "engine._x",
        "w.fp32_groups_flat_partition",
    }
    # what others may: the process group set up before any engine exists, and a ZeRO 3
    # parameter's whole size, read where the models (a leaf layer) count their parameters
    allowed = {
        "pipeline/cluster/distributed.py": {"deepspeed", "deepspeed.ops", "deepspeed.accelerator"},
        "pipeline/models/protocol.py": {"ds_numel"},
    }
    wrong = []
    for path in sorted([*ROOT.glob("pipeline/**/*.py"), *ROOT.glob("stages/**/*.py")]):
        name = path.relative_to(ROOT).as_posix()
        if name != "pipeline/training/engine.py":
            found = reaches_in(path.read_text()) - allowed.get(name, set())
            wrong += [f"{name}: {f}" for f in sorted(found)]
    assert wrong == []
    assert len(inspect.getsource(Trainer.__init__).splitlines()) < 40


def test_no_module_uses_another_modules_private_names():
    """A `_name` is its module's own: another module of the project that needs it gets it
    made public or moved, so that what a module may change freely is what it names `_x`.
    Found by reading the source: `from m import _x`, and `m._x` where `m` was imported from
    the project. Third-party privates (torch._dynamo, os._exit) are not this rule's; tests
    may reach in."""
    tools = ("launch", "bench", "reproduce", "quality", "gpu")
    dirs = ("pipeline", "stages", *tools)
    top_level = set(dirs)  # the tools run as modules (python -m bench.x): no bare names

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    def private_uses(tree: ast.AST, own_module: str) -> set[str]:
        imported = set()  # local names bound to something imported from the project
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if not node.level and source.split(".")[0] not in top_level:
                    continue
                for alias in node.names:
                    if private(alias.name) and (node.level or source != own_module):
                        found.add(alias.name)
                    imported.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in top_level:
                        imported.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in imported:
                    found.add(node.attr)
        return found

    # the scan sees both forms, and leaves a module's own names and other projects' alone
    sample = "import pipeline.x as m\nm._a\nfrom stages.y import _b, c\nc._d\nimport os\nos._exit"
    assert private_uses(ast.parse(sample), "z") == {"_a", "_b", "_d"}
    assert private_uses(ast.parse("from stages.y import _b"), "stages.y") == set()

    uses = set()
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*.py")):
            names = private_uses(ast.parse(path.read_text(), str(path)), module_name(path))
            uses |= {(path.relative_to(ROOT).as_posix(), name) for name in names}
    assert sorted(uses) == []


def test_the_tool_folders_import_no_tests_and_patch_no_sys_path():
    """bench/, reproduce/, quality/ and gpu/ run as modules of the checkout (python -m
    bench.train_step): no import of tests (what tests and tools share lives in the package
    or the tool folders), no sys.path patching (except to import code that is not ours).
    Their main()s' length: tests/unit/test_main_lengths.py."""
    outside_code = {  # the only sys.path edits: for code that is not the project's
        "bench/reference_code.py": "the user's checkout of the authors' code",
        "gpu/check.py": "wheels installed beside a read-only environment",
    }
    tools = [
        p
        for folder in ("bench", "reproduce", "quality", "gpu")
        for p in ROOT.glob(f"{folder}/**/*.py")
    ]
    assert len(tools) > 20, tools
    found = []
    for path in tools:
        name = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                modules = []
            found += [f"{name}: imports {m}" for m in modules if m.split(".")[0] == "tests"]
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("insert", "append", "extend")
                and ast.unparse(node.value) == "sys.path"
                and name not in outside_code
            ):
                found.append(f"{name}:{node.lineno}: patches sys.path")
    assert not found, "\n".join(found)


# --------------------------------------------------------------------------------------
# one training loop (pipeline/training/trainer.py)
# --------------------------------------------------------------------------------------


def loop_findings(source: str, name: str) -> list[str]:
    """What in a module's source trains on its own: a backward pass, an optimizer step, a
    torch.save of its own, or a learning rate written into an optimizer's groups."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            call = ast.unparse(node.func)
            if node.func.attr in ("backward", "step") or call == "torch.save":
                found.append((node.lineno, f"calls {call}()"))
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and ast.unparse(target.slice) == "'lr'":
                    found.append((node.lineno, "sets a learning rate"))
    return [f"{name}:{line}: {what}" for line, what in sorted(found)]


def test_the_stages_and_the_curriculum_train_only_through_the_trainer():
    """The trainer owns the updates, the learning rate and the checkpoints: no stage (the
    curriculum included) and no training hook runs a loop of its own beside it."""
    sources = [*ROOT.glob("stages/*.py"), ROOT / "pipeline" / "training" / "curriculum.py"]
    found = [
        f for path in sources for f in loop_findings(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == []


def test_the_loop_rule_sees_each_kind_of_finding():
    source = (
        "def run(engine, optimizer, model, group):\n"
        "    engine.backward(loss)\n"
        "    optimizer.step()\n"
        "    torch.save(model.state_dict(), 'state.pt')\n"
        "    group['lr'] = 0.1\n"
        "    group['lr'] *= 0.5\n"
        "    scheduler.get_lr()\n"
    )
    assert loop_findings(source, "stage.py") == [
        "stage.py:2: calls engine.backward()",
        "stage.py:3: calls optimizer.step()",
        "stage.py:4: calls torch.save()",
        "stage.py:5: sets a learning rate",
        "stage.py:6: sets a learning rate",
    ]


# --------------------------------------------------------------------------------------
# how a stage trains is its plan (pipeline/training/plan.py), asked of no stage by name
# --------------------------------------------------------------------------------------

STAGE_BLIND = [
    *sorted((ROOT / "pipeline" / "training").glob("*.py")),
    *(ROOT / "pipeline" / "commands" / m for m in ("estimate.py", "update_timing.py")),
    ROOT / "pipeline" / "commands" / "memory_report.py",
]
# also the data split and the spec section of that name (load_split(dir, "train"), the
# spec's train.*): a bare "train" is no stage, a comparison with it is
ALSO_A_SECTION = {"train"}


def stage_name_findings(source: str, name: str, stages: set[str], bare: bool) -> list[str]:
    """Where a module asks which stage it is in: a comparison (==, !=, in, not in) with a
    string that names a stage, or a tuple, list or set listing one (the stages it knows);
    with `bare`, any other string naming a stage too (docstrings aside), "train" excepted
    (ALSO_A_SECTION: a spec section's key, {"train": ...}, is no stage's name)."""
    tree = ast.parse(source, name)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    compared: set[int] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides, what = [node.left, *node.comparators], "compares with the stage name"
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            sides, what = [node], "lists the stage name"
        else:
            continue
        for side in sides:
            items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
            for item in items:
                if isinstance(item, ast.Constant) and item.value in stages:
                    if id(item) not in compared:
                        found.append((node.lineno, f"{what} {item.value!r}"))
                    compared.add(id(item))
    if bare:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and node.value in stages - ALSO_A_SECTION
                and id(node) not in compared | docstrings
            ):
                found.append((node.lineno, f"names the stage {node.value!r}"))
    return [f"{name}:{line}: {what}" for line, what in sorted(found)]


def test_no_training_module_nor_the_estimate_asks_which_stage_it_runs():
    """A stage plugin that trains is trained, estimated and timed as the built-ins are: the
    trainer and the estimate read its plan, never its name."""
    from stages import STAGES

    names = set(STAGES)
    assert {"train", "finetune", "curriculum", "evaluate"} <= names
    found = []
    for path in STAGE_BLIND:
        name = str(path.relative_to(ROOT))
        found += stage_name_findings(
            path.read_text(), name, names, name.startswith("pipeline/training")
        )
    assert found == []


def test_the_stage_name_rule_sees_each_kind_of_finding():
    source = (
        '"""The finetune stage\'s helpers (a docstring may say so)."""\n'
        "def f(spec, stage):\n"
        "    if stage == 'finetune':\n"
        "        return 1\n"
        "    if 'curriculum' in spec.stages:\n"
        "        return 2\n"
        "    if stage in ('train', 'evaluate'):\n"
        "        return spec.train, load_split(spec, 'train')\n"
        "    return {'finetune': 3}\n"
        "KNOWN = ('curriculum', 'finetune')\n"
        "spec.model_copy(update={'train': spec.train})\n"
    )
    stages = {"train", "finetune", "curriculum", "evaluate"}
    assert stage_name_findings(source, "m.py", stages, bare=False) == [
        "m.py:3: compares with the stage name 'finetune'",
        "m.py:5: compares with the stage name 'curriculum'",
        "m.py:7: compares with the stage name 'evaluate'",
        "m.py:7: compares with the stage name 'train'",
        "m.py:10: lists the stage name 'curriculum'",
        "m.py:10: lists the stage name 'finetune'",
    ]
    assert "m.py:9: names the stage 'finetune'" in stage_name_findings(
        source, "m.py", stages, bare=True
    )


def test_no_stage_module_imports_another():
    """Each stage kind stands alone (what they share is stages/base.py and
    stages/training.py, which define no STAGE): a plugin's stage is built the same way."""
    stage_modules = {
        module_name(path)
        for path in ROOT.glob("stages/*.py")
        if "\nSTAGE = " in path.read_text() or "\nSTAGE: " in path.read_text()
    }
    assert {"stages.train", "stages.finetune", "stages.curriculum"} <= stage_modules
    g = graph()
    found = [f"{m} imports {t}" for m in sorted(stage_modules) for t in g[m] & stage_modules]
    assert found == []


# --------------------------------------------------------------------------------------
# the tests' own layout (tests/conftest.py: the tiers)
# --------------------------------------------------------------------------------------

TESTS = ROOT / "tests"
TIERS = ("unit", "integration", "system")
STARTS_THINGS = {"subprocess", "deepspeed", "multiprocessing"}


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a module, functions' bodies included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module))
    return found


def layout_findings(root: Path) -> list[str]:
    """What breaks the tests' layout under `root` (a tests/ folder): a test module that imports
    another test module (shared code lives in tests/fixtures/), a test file outside the tiers'
    folders, a unit test that imports what starts processes or engines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if "example_plugin" in path.parts:
            continue  # the example plugin's own source, installed by a system test
        tree = ast.parse(path.read_text(), name)
        for line, module in imported_modules(tree):
            parts = module.split(".")
            if parts[0] == "tests" and parts[1:2] != ["fixtures"]:
                found.append(f"{name}:{line}: imports {module} (shared code: tests/fixtures/)")
            if name.startswith("unit/") and parts[0] in STARTS_THINGS:
                found.append(f"{name}:{line}: a unit test imports {module}")
        if path.name.startswith("test_") and "/" not in name and name != "test_architecture.py":
            found.append(f"{name}: a test outside the tiers' folders ({', '.join(TIERS)})")
    return found


def test_no_test_imports_another_and_unit_tests_start_nothing():
    # a folder beside the tiers is a layout nobody runs on purpose (the empty packages the
    # move to tiers left behind were one)
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {*TIERS, "fixtures"}
    assert layout_findings(TESTS) == []


def test_the_layout_rule_sees_each_kind_of_finding(tmp_path):
    (tmp_path / "unit" / "ops").mkdir(parents=True)
    (tmp_path / "unit" / "ops" / "test_a.py").write_text(
        "import subprocess\nfrom tests.unit.ops.test_b import helper\n"
        "def test_x():\n    from deepspeed import initialize\n"
    )
    (tmp_path / "test_loose.py").write_text("from tests.fixtures.runs import ROOT\n")
    assert layout_findings(tmp_path) == [
        "test_loose.py: a test outside the tiers' folders (unit, integration, system)",
        "unit/ops/test_a.py:1: a unit test imports subprocess",
        "unit/ops/test_a.py:2: imports tests.unit.ops.test_b (shared code: tests/fixtures/)",
        "unit/ops/test_a.py:4: a unit test imports deepspeed",
    ]
