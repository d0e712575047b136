"""Which package answers an import that both ferry-kv and another project's package provide,
by the environment variable that chooses (``FERRY_MOONCAKE``, ``FERRY_NIXL``): ``1`` ferry,
``0`` the other package, unset ferry unless the other package is installed, in which case the
choice is ambiguous and the import fails with an error that says how to choose."""

import importlib.machinery
import os


def installed(package):
    """Whether ``package`` is importable from ``sys.path`` (found without any import hook)."""
    return importlib.machinery.PathFinder.find_spec(package) is not None


def choice(variable, package, provides, owner):
    """``"ferry"`` or ``"other"``, or raises ImportError saying how to choose.

    ``provides`` names what is in question (``"mooncake.engine"``), ``owner`` the other
    package's project (``"Mooncake"``)."""
    value = os.environ.get(variable)
    if value is None:
        if installed(package):
            raise ImportError(
                f"both ferry-kv and {owner}'s package provide {provides}; set "
                f"{variable}=1 to use ferry or {variable}=0 to use {owner}"
            )
        return "ferry"
    if value.strip() == "1":
        return "ferry"
    if value.strip() == "0":
        return "other"
    raise ImportError(
        f"{variable}={value!r} is neither 1 (use ferry for {provides}) nor 0 (use {owner})"
    )
