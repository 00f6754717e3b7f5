"""draftling: train, measure and ship EAGLE-3 draft heads for Hugging Face causal LMs."""

__version__ = "0.1.0"
