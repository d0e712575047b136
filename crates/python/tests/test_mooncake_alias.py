"""Unmodified ``from mooncake.engine import TransferEngine`` gets ferry's engine, by the rules of
``FERRY_MOONCAKE`` (see ``ferry_kv._mooncake_alias``).

Each case runs a fresh interpreter with a clean environment (only ``PATH``, ``PYTHONPATH`` for
a fake Mooncake package, and ``FERRY_MOONCAKE`` when the case sets it), because the alias is
installed at interpreter start-up by the ``ferry_kv_mooncake.pth`` file the wheel puts in
site-packages.
"""

import os
import site
import subprocess
import sys
import sysconfig
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PTH_NAME = "ferry_kv_mooncake.pth"
CHILD_TIMEOUT_S = 60


def installed_pth():
    """The ``.pth`` in this interpreter's site-packages, or None (``maturin develop`` omits it)."""
    folders = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    folders.update(site.getsitepackages())
    for folder in folders:
        path = os.path.join(folder, PTH_NAME)
        if os.path.exists(path):
            return path
    return None


def run_child(code=None, *, ferry_mooncake=None, fake=None, script=None):
    """Runs ``code`` (or ``script``) in a fresh interpreter; returns the completed process.

    Where the ``.pth`` is not installed (a ``maturin develop`` checkout), the child first loads
    the repository's copy the way site-packages would, so the import rules are still tested;
    ``test_the_wheel_installs_the_pth_file`` is what fails in that case.
    """
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if fake is not None:
        env["PYTHONPATH"] = str(fake)
    if ferry_mooncake is not None:
        env["FERRY_MOONCAKE"] = ferry_mooncake
    prelude = ""
    if installed_pth() is None:
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


@pytest.fixture
def fake_mooncake(tmp_path):
    """A stand-in for Mooncake's package: ``mooncake``, ``mooncake.engine``, ``mooncake.store``."""
    package = tmp_path / "mooncake"
    package.mkdir()
    (package / "__init__.py").write_text("ORIGIN = 'fake'\n")
    (package / "engine.py").write_text("ORIGIN = 'fake'\n\nclass TransferEngine:\n    pass\n")
    store = "ORIGIN = 'fake'\n\nclass MooncakeDistributedStore:\n    pass\n"
    (package / "store.py").write_text(store)
    return tmp_path


def test_the_wheel_installs_the_pth_file():
    path = installed_pth()
    assert path is not None, (
        f"{PTH_NAME} is not in site-packages; install the module with "
        "`pip install ./crates/python` (or pip install the wheel), not `maturin develop`"
    )
    with open(path) as pth:
        assert pth.read().strip() == "import ferry_kv._mooncake_alias"


def test_without_mooncake_the_engine_is_ferrys_and_moves_bytes():
    child = run_child(
        script=os.path.join(HERE, "mooncake_like_caller.py")
    )
    assert child.returncode == 0, child.stdout + child.stderr
    assert child.stdout.strip() == "OK"
    child = run_child(
        """
        import ferry_kv.mooncake as ferry
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
        assert TransferEngine is ferry.TransferEngine
        assert TransferOpcode is ferry.TransferOpcode and TransferNotify is ferry.TransferNotify
        assert TransferEngine.TransferOpcode is TransferOpcode
        print("ferry")
        """
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "ferry"


def test_mooncake_installed_and_unset_is_an_error_that_says_how_to_choose(fake_mooncake):
    child = run_child(
        """
        import mooncake.store
        assert mooncake.store.ORIGIN == "fake"
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            print(error)
        else:
            print("imported", TransferEngine.__module__)
        """,
        fake=fake_mooncake,
    )
    assert child.returncode == 0, child.stderr
    message = child.stdout
    assert "FERRY_MOONCAKE=1" in message and "FERRY_MOONCAKE=0" in message, message


def test_ferry_mooncake_1_picks_ferry_and_keeps_mooncakes_other_modules(fake_mooncake):
    child = run_child(
        """
        import ferry_kv.mooncake as ferry
        import mooncake
        from mooncake.engine import TransferEngine
        from mooncake.store import MooncakeDistributedStore
        import mooncake.store
        assert TransferEngine is ferry.TransferEngine
        assert mooncake.ORIGIN == "fake" and mooncake.store.ORIGIN == "fake"
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        print("ferry engine, fake store")
        """,
        ferry_mooncake="1",
        fake=fake_mooncake,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "ferry engine, fake store"


def test_ferry_mooncake_0_picks_mooncake(fake_mooncake):
    child = run_child(
        """
        import mooncake.engine
        print(mooncake.engine.ORIGIN)
        """,
        ferry_mooncake="0",
        fake=fake_mooncake,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "fake"


def test_ferry_mooncake_0_without_mooncake_finds_no_module():
    child = run_child(
        """
        try:
            import mooncake.engine
        except ModuleNotFoundError as error:
            print(error.name)
        """,
        ferry_mooncake="0",
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "mooncake"


@pytest.mark.parametrize("with_fake", [True, False])
def test_ferry_mooncake_other_values_are_a_clear_error(fake_mooncake, with_fake):
    child = run_child(
        """
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            print(error)
        """,
        ferry_mooncake="yes",
        fake=fake_mooncake if with_fake else None,
    )
    assert child.returncode == 0, child.stderr
    message = child.stdout
    assert "FERRY_MOONCAKE='yes'" in message and "1" in message and "0" in message, message
