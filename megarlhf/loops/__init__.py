"""The trainers: the RL driver (GRPO, PPO, DAPO, ...), SFT and evaluation, and their run state."""
