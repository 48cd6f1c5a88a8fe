"""One pool of real gloo ranks per test module (spawning costs seconds on 2 cores)."""
import pytest

from expertrail.emulation.launch import LocalRanks


@pytest.fixture(scope="module")
def world4():
    with LocalRanks(4, timeout=300) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def world8():
    with LocalRanks(8, timeout=600) as ranks:
        yield ranks
