"""recgnn.hostmem.preload_allocator: run.py's process re-executed under tcmalloc / jemalloc
(or left on glibc), and a clear error for an allocator it cannot find."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from recgnn import hostmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = (
  "import os, sys; sys.path.insert(0, {root!r}); from recgnn import hostmem; "
  "m = hostmem.preload_allocator(); print(m); print(os.environ.get('LD_PRELOAD', ''))"
)


def _run(env_value, tmp_path):
  script = tmp_path / "probe.py"  # (a file: the re-executed process runs the same argv)
  script.write_text(SCRIPT.format(root=ROOT))
  env = {k: v for k, v in os.environ.items() if not k.startswith("RECGNN_MALLOC")}
  env.pop("LD_PRELOAD", None)
  if env_value is not None:
    env[hostmem.ALLOCATOR_ENV] = env_value
  return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)


def test_glibc_never_preloads(tmp_path):
  out = _run("glibc", tmp_path)
  assert out.returncode == 0, out.stderr
  assert out.stdout.splitlines() == ["glibc", ""]


def test_unknown_or_missing_allocator_is_refused_with_the_choices(tmp_path):
  out = _run("hoard", tmp_path)
  assert out.returncode != 0 and "use auto, glibc, tcmalloc, jemalloc" in out.stderr


@pytest.mark.parametrize("name", ["tcmalloc", "jemalloc"])
def test_named_allocator_is_preloaded_in_the_same_process(name, tmp_path):
  lib = hostmem.find_allocator(name)
  if lib is None:
    pytest.skip(f"no {name} here (bash benchmarks/get_allocators.sh)")
  out = _run(name, tmp_path)
  assert out.returncode == 0, out.stderr
  first, preload = out.stdout.splitlines()
  assert first == f"{name} ({lib})" and preload.split(":")[0] == lib


def test_auto_takes_tcmalloc_when_found_else_glibc(tmp_path):
  out = _run(None, tmp_path)
  assert out.returncode == 0, out.stderr
  lib = hostmem.find_allocator("tcmalloc")
  first = out.stdout.splitlines()[0]
  assert first == (f"tcmalloc ({lib})" if lib else first) and (lib or first.startswith("glibc"))
