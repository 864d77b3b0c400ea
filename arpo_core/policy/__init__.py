"""The policy side: Qwen2.5-VL model loading/building, prompts, batched generation, training sequences."""

from arpo_core.policy.generate import Generation, Generator, HFGenerator, VLLMGenerator
from arpo_core.policy.model import Policy, build_tiny_policy, load_policy
from arpo_core.policy.prompt import SYSTEM_PROMPTS, PromptInput, Reply, model_image_size
from arpo_core.policy.sequences import (
    SequenceBatch,
    collate,
    encode_prompt,
    encode_trajectory,
    sequence_logprobs,
)

__all__ = [
    "SYSTEM_PROMPTS",
    "Generation",
    "Generator",
    "HFGenerator",
    "Policy",
    "PromptInput",
    "Reply",
    "SequenceBatch",
    "VLLMGenerator",
    "build_tiny_policy",
    "collate",
    "encode_prompt",
    "encode_trajectory",
    "load_policy",
    "model_image_size",
    "sequence_logprobs",
]
