"""Reinforcement learning pieces: rewards (:mod:`mars.rl.rewards`) and the answer judge (:mod:`mars.rl.judge`);
advantages and policy losses live beside them as pure tensor functions."""
