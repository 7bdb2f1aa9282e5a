"""The package's shape: four concepts each in one place, the rest around them; imports run one
way; Keras's and TensorFlow's internals each in one module."""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).parents[1] / "tpu_scale"
# The map. The four concepts, each one package, then what stands around them.
MAP = {
    # 1. The mesh and the strategy: where the replicas are, and how a group of them sums.
    "distribute": {"mesh", "strategy", "context", "collectives", "collective_launch"},
    # 2. Batch norm over groups of replicas, and the image layers that feed it.
    "layers": {"batch_normalization", "image_normalization", "space_to_depth"},
    # 3. The input pipeline: records or a folder of images to batches, and the writer.
    "data": {
        "records",
        "input_config",
        "input_pipeline",
        "sources",
        "image_ops",
        "evaluation",
        "bad_records",
        "schema",
        "names",
        "synthetic",
        "convert",
        "beam_writer",
        "image_folder",
        "output_dir",
        "reencode",
        "_removed",
    },
    # 4. The torus gradient sum, and the sharded weight update it feeds.
    "torus": {"schedule", "all_reduce", "weight_update", "sharded_update"},
    # Around them. The recipe and the models:
    "recipe": None,
    "schedules": None,
    "optimizers": None,
    "losses": None,
    "models": {"resnet", "loading"},
    # the run:
    "training": None,
    "callbacks": None,
    "checkpointing": {"backups", "callback", "peers", "preemption"},
    # the cluster and its launch:
    "cluster": None,
    "launch": None,
    "process": None,
    # the planner, which prices and is not imported by a training run:
    "plan": {
        "__main__",
        "calibration",
        "catalog",
        "choice",
        "cli",
        "cost",
        "plot",
        "report",
        "sizing",
        "update",
    },
    # the seams to Keras's and TensorFlow's internals, the fixes for their bugs, and helpers:
    "keras_hook": None,
    "tf_seam": None,
    "_workarounds": None,
    "_files": None,
    "_lazy": None,
    "testing": {"digits", "graphs", "multiworker"},
}
# The core, lowest first, then the recipe on top of it: each may import only those before it.
CORE = [
    "tf_seam",
    "distribute.mesh",
    "distribute.context",
    "distribute.collective_launch",
    "distribute.collectives",
    "torus.schedule",
    "torus.all_reduce",
    "torus.sharded_update",
    "torus.weight_update",
    "keras_hook",
    "distribute.strategy",
    "schedules",
    "recipe",
]


def test_the_package_is_the_map():
    found = {}
    for path in PACKAGE.iterdir():
        if path.name == "__pycache__" or path.name == "__init__.py":
            continue
        if path.is_dir():
            found[path.name] = {p.stem for p in path.glob("*.py") if p.name != "__init__.py"}
        elif path.suffix == ".py":
            found[path.stem] = None
    assert set(found) == set(MAP), "add the new place to MAP, under the concept it serves"
    for place, modules in MAP.items():
        if modules is not None:
            assert found[place] == modules, f"tpu_scale.{place}: {sorted(found[place] ^ modules)}"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def _imports(path):
    """Every module a file imports, at any depth (function-level imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _graph():
    names = {name for name, _ in _modules()}
    return {
        name: {i for i in _imports(path) if i in names and i != name} for name, path in _modules()
    }


def test_no_import_cycles():
    graph = _graph()
    state = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        if state.get(node) == "open":
            cycle = trail[trail.index(node) :] + [node]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        state[node] = "open"
        for nxt in sorted(graph[node]):
            # A package imports its own submodules to re-export them; that is not a cycle back up.
            if not nxt.startswith(node + "."):
                visit(nxt, trail + [node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])


def test_core_imports_run_one_way():
    graph = _graph()
    for i, name in enumerate(CORE):
        above = {f"tpu_scale.{m}" for m in CORE[i + 1 :]}
        assert not graph[f"tpu_scale.{name}"] & above, f"tpu_scale.{name} imports a module above it"


def test_keras_internals_in_one_module():
    users = sorted(name for name, path in _modules() if "keras.src" in path.read_text())
    assert users == ["tpu_scale.keras_hook"]
    # Nor do other modules reach for Keras's private attributes of models and optimizers (the
    # package's own attributes on an optimizer are named `_tpu_scale_...`).
    private = re.compile(r"\b(model|optimizer)\._(?!_|tpu_scale_)\w+")
    reaching = sorted(
        name
        for name, path in _modules()
        if name != "tpu_scale.keras_hook" and private.search(path.read_text())
    )
    assert reaching == [], reaching


def test_tensorflow_internals_in_one_module():
    # Every `tensorflow.python` name goes through the seam's table and its start-up check.
    users = sorted(name for name, path in _modules() if "tensorflow.python" in path.read_text())
    assert users == ["tpu_scale.tf_seam"]


@pytest.mark.parametrize("name,path", list(_modules()), ids=[n for n, _ in _modules()])
def test_every_module_says_what_it_holds(name, path):
    # Modules are cut by meaning, not by a line count: each states the one concept it holds.
    text = path.read_text()
    assert ast.get_docstring(ast.parse(text)), f"{name} has no docstring"


def test_the_bfc_cpu_allocator_is_selected_only_when_asked_for():
    # TensorFlow reads the setting when it creates its CPU device: asking for it after importing
    # TensorFlow, before any op, is enough. Only the BFC allocator reports memory statistics;
    # importing the package alone leaves TensorFlow's default.
    import os
    import subprocess
    import sys

    # Without BFC, TensorFlow reports a zero peak or refuses to report ("Allocator stats not
    # available for device 'CPU:0'", seen with 2.21 on some hosts): both are "no statistics".
    code = (
        "import sys, tensorflow as tf, tpu_scale.process\n"
        "if sys.argv[1:] == ['ask']: tpu_scale.process.use_bfc_cpu_allocator()\n"
        "tf.ones(1)\n"
        "try: print(tf.config.experimental.get_memory_info('CPU:0')['peak'] > 0)\n"
        "except ValueError: print(False)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}

    def statistics(*args, **variables):
        done = subprocess.run(
            [sys.executable, "-c", code, *args],
            env=dict(env, **variables),
            capture_output=True,
            text=True,
            timeout=300,
        )
        return done.stdout.strip(), done.stderr[-2000:]

    assert statistics()[0] == "False", statistics()[1]  # imported, not asked: the default
    assert statistics("ask")[0] == "True", statistics("ask")[1]
    # 0, set by the user, keeps TensorFlow's default allocator even when the package is asked.
    off = statistics("ask", TF_CPU_ALLOCATOR_USE_BFC="0")
    assert off[0] == "False", off[1]


def test_a_module_that_moved_names_its_new_home():
    import tpu_scale

    with pytest.raises(ImportError, match="tpu_scale.strategy is now tpu_scale.distribute.strategy"):
        from tpu_scale import strategy  # noqa: F401
    with pytest.raises(ImportError, match="tpu_scale.torus_schedule is now tpu_scale.torus.schedule"):
        tpu_scale.torus_schedule  # noqa: B018
    assert not hasattr(tpu_scale, "no_such_module")
