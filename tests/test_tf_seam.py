"""The TensorFlow seam: every private TensorFlow name in one table, checked at start-up."""

import ast
import pathlib

import pytest
import tensorflow as tf

import tpu_scale
from tpu_scale import tf_seam

PACKAGE = pathlib.Path(__file__).parents[1] / "tpu_scale"


def test_this_tensorflow_has_every_name_in_the_table():
    assert tf_seam.missing_names() == []
    for name, path in tf_seam.MODULES.items():
        assert getattr(tf_seam, name) is not None, f"{path} cannot be imported"
    tf_seam.check_tensorflow()


def test_a_tensorflow_without_a_private_name_fails_at_create_strategy(monkeypatch):
    # As a TensorFlow release that dropped or renamed it would be.
    monkeypatch.delattr(tf_seam.control_flow_util, "GraphOrParentsInXlaContext")
    with pytest.raises(ImportError) as raised:
        tpu_scale.create_strategy(num_cpu_replicas=2)
    message = str(raised.value)
    assert "tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext not found" in message
    assert f"TensorFlow {tf.__version__}" in message
    assert f"supports tensorflow{tf_seam.SUPPORTED_TENSORFLOW}" in message
    assert f"pip install 'tensorflow{tf_seam.SUPPORTED_TENSORFLOW}'" in message


def test_a_missing_method_of_a_private_class_is_named(monkeypatch):
    extended = tf_seam.collective_all_reduce_strategy.CollectiveAllReduceExtended
    monkeypatch.delattr(extended, "_initialize_local_devices")
    with pytest.raises(ImportError, match=r"CollectiveAllReduceExtended\._initialize_local_devices not found"):
        tpu_scale.create_strategy(num_cpu_replicas=2)


def test_a_tensorflow_without_a_private_module_names_each_of_its_names(monkeypatch):
    monkeypatch.setattr(tf_seam, "autograph_api", None)  # the module failed to import
    assert tf_seam.missing_names() == ["tensorflow.python.autograph.impl.api.tf_convert"]
    with pytest.raises(ImportError, match=r"autograph\.impl\.api\.tf_convert not found"):
        tpu_scale.create_strategy(num_cpu_replicas=2)


def test_the_table_lists_every_name_the_package_takes_from_the_seam():
    doc = tf_seam.__doc__
    for module, name in tf_seam.NAMES:
        assert tf_seam.MODULES[module].removeprefix("tensorflow.python.") in doc, module
        for part in name.split("."):
            assert f".{part}" in doc, (module, name)
    # Every module of the table is taken by some module of the package (or its names are called
    # on TensorFlow's own objects), and nothing else is.
    taken = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "tpu_scale.tf_seam":
                taken.update(alias.name for alias in node.names)
    assert taken | set(tf_seam.OBJECT_ONLY) == set(tf_seam.MODULES)
    assert not taken & set(tf_seam.OBJECT_ONLY)


def test_install_requirements_pin_the_supported_tensorflow():
    setup = (PACKAGE.parent / "setup.py").read_text()
    assert f'"tensorflow{tf_seam.SUPPORTED_TENSORFLOW}"' in setup
