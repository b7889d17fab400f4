r"""DeepFM (recgnn/models/deepfm.py) on the Kaggle DLRM's data, tables and MLP widths: the
factorization machine and the deep MLP (432-512-256-1) over the same 26 embeddings (dim 16)
and the bottom MLP's field (13-512-256-64-16), every table dense.

  python run.py --experiment=deepfm_kaggle                     # synthetic default
  python run.py --experiment=deepfm_kaggle --config.data.path=/data/criteo/train.txt
  python run.py --experiment=deepfm_kaggle \
    --config.embeddings.plan="(('.*', 'offload(cache_fraction=0.05, min_cache_rows=2048)'),)"

Everything but the model is dlrm_kaggle's (experiments/dlrm_kaggle.py), so the two compare on
the same batches; docs/models.md has both AUCs.
"""

from experiments import _options, dlrm_kaggle


def get_config(arg=None):
  _options.parse(arg, {}, name="deepfm_kaggle")  # no options: an ARG would be ignored
  c = dlrm_kaggle.get_config()
  c.model.name = "deepfm"
  c.model.bottom = (512, 256, 64, 16)  # the last width: the embedding dim (one more FM field)
  c.model.top = (512, 256, 1)  # the deep MLP over the 27 fields concatenated
  del c.model["cross_layers"], c.model["low_rank"]  # (dcn's)
  return c
