"""Where users train: ``eae_func.integrations.transformers.EAETrainer`` (Hugging Face Trainer)."""
