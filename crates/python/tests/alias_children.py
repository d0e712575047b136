"""Fresh interpreters for the import-hook tests: each runs with a clean environment (only
``PATH``, ``PYTHONPATH`` for a fake package, and the variables a case sets), because the hooks
are installed at interpreter start-up by the ``.pth`` files the wheel puts in site-packages."""

import os
import site
import subprocess
import sys
import sysconfig
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_TIMEOUT_S = 60


def installed_pth(name):
    """The ``.pth`` called ``name`` in this interpreter's site-packages, or None (``maturin
    develop`` omits it)."""
    folders = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    folders.update(site.getsitepackages())
    for folder in folders:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    return None


def run_child(pth, code=None, *, variables=None, fake=None, script=None):
    """Runs ``code`` (or ``script``) in a fresh interpreter; returns the completed process.

    Where ``pth`` is not installed (a ``maturin develop`` checkout), the child first loads the
    repository's copy the way site-packages would, so the import rules are still tested; the
    test that the wheel installs ``pth`` is what fails in that case.
    """
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if fake is not None:
        env["PYTHONPATH"] = str(fake)
    env.update(variables or {})
    prelude = ""
    if installed_pth(pth) is None:
        repo_copy = os.path.join(HERE, "..")
        prelude = f"import site; site.addsitedir({os.path.abspath(repo_copy)!r})\n"
    if script is not None:
        body = prelude + f"import runpy; runpy.run_path({script!r}, run_name='__main__')\n"
    else:
        body = prelude + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", body],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
