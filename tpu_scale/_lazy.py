"""Public names of a package imported on first use: the one scheme every `__init__` uses.

The mesh geometry and the pod-scale planner are pure Python and need no TensorFlow, and `python
-m tpu_scale.data.convert` must reach its own module before its package imports it (else Python
runs a module that is already imported): a package lists its public names and the modules that
define them, and each is imported when first read.

    __getattr__ = _lazy.attributes(__name__, {"ImageNetInput": "tpu_scale.data.input_pipeline"},
                                   submodules=("image_ops",))
"""

import importlib
import sys


def attributes(package, public, submodules=(), moved=None):
    """A module-level `__getattr__` for `package` that imports its names on first use.

    Args:
      package: the package's `__name__`.
      public: `{name: module}`: each public name and the module that defines it.
      submodules: names of the package's submodules that are read as attributes.
      moved: `{name: new home}` of modules that left the package: reading one (or `from package
        import name`) raises an ImportError naming where it went.

    Returns:
      The `__getattr__` function; the value it imports is bound in the package, so it runs once
      per name (a submodule of the same name as a public function stays the function).
    """

    def __getattr__(name):
        if name in public:
            value = getattr(importlib.import_module(public[name]), name)
        elif name in submodules:
            value = importlib.import_module(f"{package}.{name}")
        elif moved and name in moved:
            # An ImportError, not an AttributeError: `from package import name` then shows this
            # message rather than Python's "cannot import name".
            raise ImportError(f"{package}.{name} is now {moved[name]}: import it from there.")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
