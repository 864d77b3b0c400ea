"""The policy side: Qwen2.5-VL model loading/building (model), prompts (prompt), batched generation
(generate, decode), training sequences (sequences).

Nothing is re-exported here: importing the package must not import torch and transformers, so a module
that needs only the prompt types (`arpo_core.policy.prompt`, e.g. the rollout loop and the stage table
above it) stays light. Import the submodule you need.
"""
