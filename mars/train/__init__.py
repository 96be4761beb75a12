"""Training: optimisation, SFT and RL trainers shared by the sft and rl stages."""
