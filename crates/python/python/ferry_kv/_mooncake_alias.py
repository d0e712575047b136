"""Lets unmodified code import ``mooncake.engine`` and get ferry's compatible engine.

A ``.pth`` file installed with the wheel imports this module at interpreter start-up. It only
installs an import hook; nothing is loaded until some code imports ``mooncake.engine``. Then:

- ``FERRY_MOONCAKE=1``: ``mooncake.engine`` is ``ferry_kv.mooncake``.
- ``FERRY_MOONCAKE=0``: the hook stands aside (Mooncake's own package, if installed, loads).
- unset: ferry's engine when Mooncake's package is not installed; when it is, the choice is
  ambiguous and the import fails with an error that says how to choose.

Only ``mooncake.engine`` is provided: other modules of Mooncake's package (``mooncake.store``)
still come from Mooncake's package when it is installed.
"""

import importlib.abc
import importlib.util
import sys

from ._alias_choice import choice as _decide
from ._alias_choice import installed as _installed

_TARGET = "mooncake.engine"
_VARIABLE = "FERRY_MOONCAKE"


def _mooncake_installed():
    """Whether Mooncake's own package is importable (found without this hook)."""
    return _installed("mooncake")


def _choice():
    """``"ferry"`` or ``"mooncake"``, or raises ImportError saying how to choose."""
    decided = _decide(_VARIABLE, "mooncake", _TARGET, "Mooncake")
    return "ferry" if decided == "ferry" else "mooncake"


class _Package(importlib.abc.Loader):
    """An empty ``mooncake`` package, for machines without Mooncake's."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []


class _Engine(importlib.abc.Loader):
    """``mooncake.engine`` as ``ferry_kv.mooncake``."""

    def create_module(self, spec):
        from . import mooncake

        return mooncake

    def exec_module(self, module):
        pass


class MooncakeAlias(importlib.abc.MetaPathFinder):
    """The import hook: answers for ``mooncake.engine`` (and ``mooncake`` when absent)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "mooncake":
            # Mooncake's own package always loads when installed (its `store` and the rest stay
            # usable whatever is chosen); only its `engine` module is in question.
            if _mooncake_installed() or _choice() != "ferry":
                return None
            return importlib.util.spec_from_loader("mooncake", _Package(), is_package=True)
        if fullname == _TARGET and _choice() == "ferry":
            return importlib.util.spec_from_loader(_TARGET, _Engine())
        return None


def install():
    """Puts the hook first on ``sys.meta_path``, once."""
    if not any(isinstance(finder, MooncakeAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, MooncakeAlias())


install()
