"""The learner: trainer backends behind the `Trainer` protocol (torch, Megatron, LoRA adapters), their losses,
advantages, logprobs and checkpoints."""
