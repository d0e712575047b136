"""Unmodified ``import nixl`` / ``from nixl._api import nixl_agent`` gets ferry's agent, by the
rules of ``FERRY_NIXL`` (see ``ferry_kv._nixl_alias``), and passes the availability and version
checks vLLM makes before it uses NIXL. Each case runs in a fresh interpreter."""

import pytest
from alias_children import installed_pth, run_child

PTH_NAME = "ferry_kv_nixl.pth"

# What vLLM 0.33 checks before its NixlConnector starts (vllm/distributed/nixl_utils.py), as
# behaviour: `find_spec("nixl")` must find a module; `nixl._api` must give `nixl_agent` and
# `nixl_agent_config`; the first installed distribution that provides the top-level name `nixl`
# must be at least version 1.5.0 (none is fine).
VLLM_CHECKS = """
import importlib, importlib.metadata, importlib.util

assert importlib.util.find_spec("nixl") is not None, "is_nixl_available would be False"
api = importlib.import_module("nixl._api")
wrapper, config = api.nixl_agent, api.nixl_agent_config
providers = importlib.metadata.packages_distributions().get("nixl", ())
for dist in providers:
    installed = tuple(int(part) for part in importlib.metadata.version(dist).split(".")[:3])
    assert installed >= (1, 5, 0), f"vLLM refuses {dist}=={installed}"
    break
import nixl, nixl._bindings
assert nixl.nixl_agent is wrapper and nixl._bindings.NIXL_INIT_AGENT == ""
assert issubclass(nixl.nixlNotFoundError, Exception)
print("passes", wrapper.__module__, list(providers))
"""


@pytest.fixture
def fake_nixl(tmp_path):
    """A stand-in for NIXL's package: ``nixl``, ``nixl._api``."""
    package = tmp_path / "nixl"
    package.mkdir()
    (package / "__init__.py").write_text("ORIGIN = 'fake'\n")
    (package / "_api.py").write_text("ORIGIN = 'fake'\n\nclass nixl_agent:\n    pass\n")
    return tmp_path


def child(code, ferry_nixl=None, fake=None):
    variables = {"FERRY_NIXL_HOST": "127.0.0.1"}
    if ferry_nixl is not None:
        variables["FERRY_NIXL"] = ferry_nixl
    return run_child(PTH_NAME, code, variables=variables, fake=fake)


def test_the_wheel_installs_the_pth_file():
    path = installed_pth(PTH_NAME)
    assert path is not None, f"{PTH_NAME} is not in site-packages; pip install the wheel"
    with open(path) as pth:
        assert pth.read().strip() == "import ferry_kv._nixl_alias"


def test_without_nixl_vllm_s_checks_pass_and_the_agent_is_ferry_s():
    ran = child(VLLM_CHECKS + "\nagent = wrapper('a', config(capture_telemetry=True))\nprint(agent.name)\n")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.split("\n")[:2] == ["passes ferry_kv._nixl_api []", "a"]


def test_nixl_installed_and_unset_is_an_error_that_says_how_to_choose(fake_nixl):
    ran = child(
        """
        try:
            import nixl._api
        except ImportError as error:
            print(error)
        """,
        fake=fake_nixl,
    )
    assert ran.returncode == 0, ran.stderr
    assert "FERRY_NIXL=1" in ran.stdout and "FERRY_NIXL=0" in ran.stdout, ran.stdout


def test_ferry_nixl_1_picks_ferry_over_an_installed_nixl(fake_nixl):
    ran = child(VLLM_CHECKS, ferry_nixl="1", fake=fake_nixl)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.startswith("passes ferry_kv._nixl_api"), ran.stdout


def test_ferry_nixl_0_picks_nixl(fake_nixl):
    ran = child("import nixl._api\nprint(nixl._api.ORIGIN)\n", ferry_nixl="0", fake=fake_nixl)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "fake"


def test_ferry_nixl_other_values_are_a_clear_error():
    ran = child(
        """
        try:
            import nixl
        except ImportError as error:
            print(error)
        """,
        ferry_nixl="yes",
    )
    assert ran.returncode == 0, ran.stderr
    assert "FERRY_NIXL='yes'" in ran.stdout, ran.stdout
