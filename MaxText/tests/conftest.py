"""Test session set-up: in-process tests share the test processes' compilation cache."""

from MaxText import jax_runtime
from MaxText.tests.helpers import TEST_JAX_CACHE_DIR

jax_runtime.enable_compilation_cache(TEST_JAX_CACHE_DIR)
