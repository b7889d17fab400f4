#!/usr/bin/env bash
# Installs the peer (comparison) stack for the side-by-side benchmarks: PyTorch, TorchRec +
# FBGEMM (CPU), PyTorch Geometric with torch-scatter / torch-sparse. CPU only, Python 3.11.
#
# Why not a plain `pip install -e .[bench]`: torchrec 1.8.0 requires `fbgemm-gpu` (the CUDA
# build), so torchrec and fbgemm-gpu-cpu must go in with --no-deps; every other step pins
# torch through a constraints file so pip never swaps the local CPU build for a CUDA one.
#
# Usage: bash benchmarks/peers/install.sh [WHEEL_DIR]
#   WHEEL_DIR: prebuilt torch-scatter / torch-sparse wheels (default /work/shared/peers/wheels).
set -euo pipefail

WHEELS="${1:-/work/shared/peers/wheels}"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"
PIP=(python -m pip install -c "$CONSTRAINTS")

# 1. torch: 2.13.0 resolves to the local CPU build; any other version pulls GBs of CUDA.
"${PIP[@]}" torch==2.13.0
# 2. TorchRec + FBGEMM CPU kernels. fbgemm-gpu-cpu 1.9.0 fails to load with torch 2.13
#    (undefined symbol); torchrec's own fbgemm-gpu requirement is the CUDA build.
"${PIP[@]}" --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0
# 3. TorchRec's pure-Python dependencies.
"${PIP[@]}" tensordict torchmetrics==1.0.3 tqdm pyre-extensions
# 4. PyG. NeighborLoader needs torch-sparse (or pyg-lib, which is not on the index).
"${PIP[@]}" torch-geometric==2.8.1 scipy  # (torch-sparse imports scipy)
# 5. torch-scatter 2.1.2 / torch-sparse 0.6.18 built for torch 2.13.0 / cp311 / x86_64
#    (building them from source takes ~15 minutes, torch-sparse only with ninja off).
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "${PIP[@]}" --no-deps "$WHEELS"/*.whl
else
  # Not exercised on this machine (the wheels were prebuilt once); takes ~15 minutes.
  echo "No wheels in $WHEELS; building torch-scatter / torch-sparse from source." >&2
  "${PIP[@]}" --no-deps --no-build-isolation torch-scatter==2.1.2 torch-sparse==0.6.18
fi

python -c "
import torch, torchrec, fbgemm_gpu, torch_geometric, torch_sparse
from torch_geometric.loader import NeighborLoader
print('peers OK: torch', torch.__version__, '| torchrec', torchrec.__version__,
      '| torch_geometric', torch_geometric.__version__, '| torch_sparse', torch_sparse.__version__)
"
