"""A persistent XLA compilation cache for one test module (import `compilation_cache` into it).

Modules that train the same config several times (resume, crash and equality checks) compile
the same steps once per run; with this cache they compile them once. It is set up for the
importing module only and dropped afterwards, so other modules run as they always do.
"""

import os

import jax
import pytest

ENV = "RECGNN_TEST_XLA_CACHE"  # subprocesses of the module read the directory from here
_KEYS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
         "jax_persistent_cache_min_entry_size_bytes")  # fmt: skip


def enable(directory: str) -> None:
  for k, v in zip(_KEYS, (directory, 0.0, 0)):
    jax.config.update(k, v)


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("xla_cache"))
  old = {k: getattr(jax.config, k) for k in _KEYS}
  enable(d)
  os.environ[ENV] = d
  yield d
  for k, v in old.items():
    jax.config.update(k, v)
  os.environ.pop(ENV, None)
  try:  # the cache object is built once per process: drop it so later modules run uncached
    from jax._src import compilation_cache as cc

    cc.reset_cache()
  except (ImportError, AttributeError):
    pass
