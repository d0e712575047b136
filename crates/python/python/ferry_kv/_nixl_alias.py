"""Lets unmodified code ``import nixl`` (``nixl._api``, ``nixl._bindings``) and get ferry's
NIXL agent, as vLLM's ``NixlConnector`` and Dynamo do.

A ``.pth`` file installed with the wheel imports this module at interpreter start-up. It only
installs an import hook; nothing is loaded until some code imports ``nixl``. Then:

- ``FERRY_NIXL=1``: ``nixl``, ``nixl._api`` and ``nixl._bindings`` are ferry's
  (``ferry_kv.nixl``, ``ferry_kv._nixl_api``, ``ferry_kv._nixl_bindings``).
- ``FERRY_NIXL=0``: the hook stands aside (NIXL's own package, if installed, loads).
- unset: ferry's when NIXL's package is not installed; when it is, the choice is ambiguous and
  the import fails with an error that says how to choose.

No ``nixl`` folder is installed: vLLM reads the version of whichever installed distribution
provides ``nixl`` and refuses old ones, and the hook provides the module without claiming a
distribution, so vLLM's check finds none and passes.
"""

import importlib
import importlib.abc
import importlib.util
import sys

from ._alias_choice import choice as _decide

_VARIABLE = "FERRY_NIXL"
_MODULES = {
    "nixl": "ferry_kv.nixl",
    "nixl._api": "ferry_kv._nixl_api",
    "nixl._bindings": "ferry_kv._nixl_bindings",
}


def _chosen():
    """Whether ferry answers for ``nixl``; raises ImportError when the choice is ambiguous."""
    return _decide(_VARIABLE, "nixl", "nixl", "NIXL") == "ferry"


class _Package(importlib.abc.Loader):
    """``nixl``: a package holding every public name of ``ferry_kv.nixl``, as NIXL's own
    package holds those of its ``_api`` and ``_bindings``."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from . import nixl

        module.__path__ = []
        for name in nixl.__all__:
            setattr(module, name, getattr(nixl, name))
        module.__all__ = list(nixl.__all__)


class _Submodule(importlib.abc.Loader):
    """``nixl._api`` or ``nixl._bindings`` as ferry's module of the same job."""

    def __init__(self, source):
        self.source = source

    def create_module(self, spec):
        return importlib.import_module(self.source)

    def exec_module(self, module):
        pass


class NixlAlias(importlib.abc.MetaPathFinder):
    """The import hook: answers for ``nixl`` and its two modules vLLM imports."""

    def find_spec(self, fullname, path=None, target=None):
        source = _MODULES.get(fullname)
        if source is None or not _chosen():
            return None
        if fullname == "nixl":
            return importlib.util.spec_from_loader("nixl", _Package(), is_package=True)
        return importlib.util.spec_from_loader(fullname, _Submodule(source))


def install():
    """Puts the hook first on ``sys.meta_path``, once."""
    if not any(isinstance(finder, NixlAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, NixlAlias())


install()
