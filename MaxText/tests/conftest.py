"""Test session set-up: CPU devices, libtpu only for topology descriptions, one shared compilation cache."""

import os

# Tests run on CPU devices even where libtpu is installed (the test requirements have it for the TPU
# topology tests): without this every JAX process would try to start a TPU and contend for libtpu's lock.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no TPU metadata server to ask
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Every compile goes to the shared cache, also the small ones (runs elsewhere cache those over 0.5 s): with a warm
# cache the tests, and the processes they start, compile about half as much.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# pylint: disable=wrong-import-position
from MaxText.runtime import jax_runtime
from MaxText.tests.helpers import TEST_JAX_CACHE_DIR

jax_runtime.enable_compilation_cache(TEST_JAX_CACHE_DIR)
