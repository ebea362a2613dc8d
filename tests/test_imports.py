"""The house's import graph: no circles among our modules (every `import` statement counts, those
inside functions and importlib.import_module("name") too: that is how a circle hides), and
`import model` stays light."""
import ast
import os
import subprocess
import sys

from conftest import REPO


def project_files(folder):
    """The .py files of `folder` that the project holds: git's, where the checkout is a git one (a user's
    own script saved beside train.py, as the README's examples run from here, is not the project's and
    must not be imported by its tests), else every one."""
    names = sorted(name for name in os.listdir(folder) if name.endswith(".py"))
    try:
        tracked = subprocess.run(["git", "ls-files", "--cached", "--", "*.py"], cwd=folder, capture_output=True,
                                 text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return names
    if tracked.returncode != 0:
        return names
    known = {os.path.basename(line) for line in tracked.stdout.splitlines() if "/" not in line}
    return [name for name in names if name in known]


def our_modules():
    """{module name: file} for the top-level scripts and modules and every file of our packages
    (nanogns and its subpackages, the normgnorm name it keeps)."""
    found = {name[:-3]: os.path.join(REPO, name) for name in project_files(REPO)}
    for package in ("nanogns", "normgnorm"):
        for folder, _, _ in os.walk(os.path.join(REPO, package)):
            if not os.path.isfile(os.path.join(folder, "__init__.py")):
                continue
            dotted = os.path.relpath(folder, REPO).replace(os.sep, ".")
            for name in project_files(folder):
                found[dotted if name == "__init__.py" else f"{dotted}.{name[:-3]}"] = os.path.join(folder, name)
    return found


def test_a_users_script_beside_train_py_is_not_the_projects(tmp_path):
    """The README's examples run from the repository root: a user who saves one there (which runs a
    training loop when imported) keeps the tests' import checks to the project's own files."""
    script = os.path.join(REPO, "my_own_loop_example_for_the_tests.py")
    with open(script, "w") as f:
        f.write("raise SystemExit('a user script, imported by the tests')\n")
    try:
        assert "my_own_loop_example_for_the_tests" not in our_modules() and "train" in our_modules()
    finally:
        os.remove(script)


def import_graph():
    """{module: set of our modules it imports}, from the ast of each file."""
    modules = our_modules()
    graph = {}
    for name, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from .x import y
                    base = f"{package}.{base}" if base else package
                # `from package import submodule` imports the submodule; `from module import name`, the module
                submodules = {f"{base}.{alias.name}" for alias in node.names} & set(modules)
                targets.update(submodules or {base})
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                targets.add(node.args[0].value)  # importlib.import_module("name"): an import all the same
        # a package's own modules load it first by Python's rule: that is no circle
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def find_cycle(graph):
    """One import circle as a list of modules (first == last), or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_our_modules_import_each_other_without_circles():
    graph = import_graph()
    assert {"model", "checkpoint", "nanogns.estimators.exact", "nanogns.estimators.ddp", "nanogns.layers"} <= set(graph)
    assert "checkpoint" in graph["train"] and "nanogns.layers" in graph["nanogns.estimators.exact"]  # it sees imports
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_module_imports_in_a_fresh_interpreter():
    names = [n for n in our_modules() if n.isidentifier() or "." in n]
    names = [n for n in names if n not in ("train", "sample", "configurator")]  # scripts: they run on import
    code = "import importlib, sys\nfor n in sys.argv[1:]: importlib.import_module(n)"
    p = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_import_model_does_not_import_the_estimators():
    code = ("import sys, model\n"
            "print(' '.join(m for m in sys.modules if m.startswith('nanogns.estimators') or m in "
            "('checkpoint', 'nanogns.runlog')))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == ""


def test_no_docstring_names_a_file_the_repository_does_not_have():
    """A module's text that names a .md file names one this checkout has (by its path from the root or
    from the module's folder, or, for a bare name, anywhere in the project)."""
    import re
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, timeout=30)
    if tracked.returncode != 0:
        import pytest
        pytest.skip("not a git checkout")
    files = set(tracked.stdout.splitlines())
    names = {os.path.basename(f) for f in files}
    missing = []
    for module, path in our_modules().items():
        with open(path) as f:
            text = f.read()
        for named in set(re.findall(r"\b([\w./-]+\.md)\b", text)):
            folder = os.path.relpath(os.path.dirname(path), REPO)
            if named not in files and os.path.normpath(os.path.join(folder, named)) not in files and named not in names:
                missing.append(f"{module}: {named}")
    assert missing == []


# the names code written for the reference (or this repository's earlier layout) imports: each is the package's module
COMPATIBILITY_NAMES = {"buffered": "nanogns.layers", "gnstracking": "nanogns.estimators.exact",
                       "ddpgns": "nanogns.estimators.ddp", "tracker": "nanogns.runlog",
                       "layer_config": "nanogns.layers.config", "normgnorm": "nanogns.normgnorm",
                       "gnsmeter": "nanogns.meter", "hf_gns": "nanogns.hf", "lightning_gns": "nanogns.lightning"}


def test_the_house_stays_small_top_level_modules_few_and_every_module_short():
    top_level = project_files(REPO)
    assert len(top_level) <= 16, top_level
    long = {name: n for name, path in our_modules().items() if (n := sum(1 for _ in open(path))) > 900}
    assert long == {}


def test_each_compatibility_name_is_the_package_module_and_holds_no_logic():
    code = ("import importlib, json, sys\n"
            "pairs = json.loads(sys.argv[1])\n"
            "print(all(importlib.import_module(old) is importlib.import_module(new) for old, new in pairs.items()))")
    import json
    p = subprocess.run([sys.executable, "-c", code, json.dumps(COMPATIBILITY_NAMES)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr[-2000:]
    for old in COMPATIBILITY_NAMES:
        path = os.path.join(REPO, old, "__init__.py") if old == "normgnorm" else os.path.join(REPO, f"{old}.py")
        tree = ast.parse(open(path).read())
        statements = [node for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
        assert all(isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign)) for node in statements), old
        assert len(statements) <= 3, old


# the top-level names kept for the reference's code and this repository's earlier code
OLD_NAMES = ("buffered", "gnstracking", "ddpgns", "tracker", "layer_config", "normgnorm", "fused_gns", "gnsmeter",
             "hf_gns", "lightning_gns")
# of which nanogns.normgnorm is the package's own name too, and "the tracker's" is English


def test_the_package_names_only_its_own_modules():
    # a pip user has nanogns.runlog, not tracker: inside the package, no import, message or docstring
    # names an old top-level module, but where it says what the reference's code imports (refusals.py,
    # each module's module_refusals line and the comments on it) and the log's writer tag (data)
    import re
    old = "|".join(n for n in OLD_NAMES if n != "normgnorm")
    owned = "|".join(n for n in OLD_NAMES if n not in ("normgnorm", "tracker"))
    pattern = re.compile(rf"(?<![\w./])({old})\.\w|(?<![\w./])({owned})'s\b|\bimport ({old})\b|\bas ({old})\b")
    found = []
    for folder, _, files in os.walk(os.path.join(REPO, "nanogns")):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, REPO)
            if rel == os.path.join("nanogns", "refusals.py"):
                continue
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    if ("module_refusals(" in line or "reference" in line or line.startswith("WRITER_KEY")
                            or not pattern.search(line)):
                        continue
                    found.append(f"{rel}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)
