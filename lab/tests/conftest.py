"""The lab's CPU tests share the product tests' fixtures (tests/conftest.py)."""

from tests.conftest import as_captured, one_thread, smol_tokenizer, tiny_target, tiny_target_dir  # noqa: F401
