"""Rank script for tests/loops/test_rl.py: a short RL run of the real driver on a tiny model."""
import sys

from megarlhf.config import RunConfig, load_config
from megarlhf.loops.rl import train_rl


def main() -> None:
    recipe, overrides = sys.argv[1], sys.argv[2:]
    train_rl(load_config(RunConfig, recipe, overrides))


if __name__ == "__main__":
    main()
