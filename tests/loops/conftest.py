"""Shared fixture of the driver tests: a tiny Qwen2 model and a small synthetic arithmetic task."""
import pytest

from megarlhf.data.synthetic import write_arithmetic_task
from model_providers.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def rl_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    model = make_tiny_model("qwen2", root / "model", seed=0)
    write_arithmetic_task(root / "data", n_train=32, n_heldout=8, seed=0, max_steps=1, instruction=None)
    return model, root / "data"
