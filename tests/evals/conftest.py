import pytest

from tests.evals.replica import Replica


@pytest.fixture(scope="module")
def replica(tiny_llama_dir, tmp_path_factory):
    """A real `inferops serve` of the tiny checkpoint, ready, for one test module."""
    served = Replica(tiny_llama_dir, tmp_path_factory.mktemp("replica") / "serve.log").start()
    try:
        yield served.wait_ready()
    finally:
        served.stop()
