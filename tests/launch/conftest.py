"""Fixtures of the launch tests: one tiny model and task, one 2-rank torchrun reference run of
examples/recipes/tiny_ppo.yaml, and the ``slurm`` marker (tests that need a real local Slurm: root,
apt-get and a few minutes; left out unless selected with ``-m slurm``)."""
from pathlib import Path

import pytest

from _launch_common import run_single_node_script


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: needs a local single-node Slurm (root + apt-get); run with -m slurm")


def pytest_collection_modifyitems(config, items):
    if "slurm" in (config.option.markexpr or ""):
        return
    deselected = [item for item in items if item.get_closest_marker("slurm")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("slurm")]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    from megarlhf.data.synthetic import write_arithmetic_task
    from model_providers.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("launch")
    model = make_tiny_model("qwen2", root / "model", seed=0)
    data = write_arithmetic_task(root / "data", n_train=32, n_heldout=8, seed=0, max_steps=1, instruction=None)
    return model, Path(data["train"])


@pytest.fixture(scope="session")
def torchrun_reference(tiny_assets, tmp_path_factory):
    """Metrics of the tiny recipe launched by examples/torchrun/single_node.sh on 2 ranks."""
    return run_single_node_script(tiny_assets, tmp_path_factory.mktemp("torchrun") / "run")
