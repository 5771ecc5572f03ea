"""Where users train: ``eae_func.integrations.transformers.EAETrainer`` (Hugging Face Trainer) and
``eae_func.integrations.lightning.manual_step`` (Lightning)."""


def missing(where: str, extra: str, e: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error for an integration whose library is not installed, naming the extra that brings it."""
    return ModuleNotFoundError(
        f"{where}: {e.name} is not installed; it comes with eae_func's {extra} extra: pip install 'eae_func[{extra}]'",
        name=e.name,
    )
