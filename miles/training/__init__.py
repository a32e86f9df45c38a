"""The run: `miles train` and `miles sft`, the train loop over a `PolicyRun`, rollout sources, evaluation,
health, placement of ranks and roles (torchrun, Ray)."""
