"""Training: tree packing, the trainer, the SFT warm start and weight publication."""
