"""Stage 5-7: the training-time-test objective, the online trainer, checkpoints and resume."""
