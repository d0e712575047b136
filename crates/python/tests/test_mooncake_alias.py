"""Unmodified ``from mooncake.engine import TransferEngine`` gets ferry's engine, by the rules of
``FERRY_MOONCAKE`` (see ``ferry_kv._mooncake_alias``).

Each case runs a fresh interpreter with a clean environment (only ``PATH``, ``PYTHONPATH`` for
a fake Mooncake package, and ``FERRY_MOONCAKE`` when the case sets it), because the alias is
installed at interpreter start-up by the ``ferry_kv_mooncake.pth`` file the wheel puts in
site-packages.
"""

import os

import pytest
from alias_children import HERE
from alias_children import installed_pth as _installed_pth
from alias_children import run_child as _run_child

PTH_NAME = "ferry_kv_mooncake.pth"


def installed_pth():
    return _installed_pth(PTH_NAME)


def run_child(code=None, *, ferry_mooncake=None, fake=None, script=None):
    variables = {} if ferry_mooncake is None else {"FERRY_MOONCAKE": ferry_mooncake}
    return _run_child(PTH_NAME, code, variables=variables, fake=fake, script=script)


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
