"""Test configuration: hypothesis profiles, the golden-update flag, the gpu marker."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True)
settings.register_profile("long", deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile("ci")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true",
                     help="rewrite golden expected files from the current output")


def pytest_configure(config: pytest.Config) -> None:
    from kerncc import config as kconfig

    settings.load_profile(kconfig.hypothesis_profile())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    from kerncc.runtime.backends.probe import cuda_devices

    count, why = cuda_devices()
    if count:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))
