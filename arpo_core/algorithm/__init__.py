"""The method (docs/method.md): group-relative advantages, the clipped policy loss, the replay buffer,
valuable task selection, the update step and its engines (torch, DeepSpeed), rollouts of episode groups
over an env pool, and the trainer's epoch loop that puts them together."""
