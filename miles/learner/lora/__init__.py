"""Many LoRA adapters on one base: the adapters' trainer, its process, the run's adapter side, export."""
