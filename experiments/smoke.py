"""Tiny end-to-end run (seconds): small synthetic data, small DLRM, a few steps and a checkpoint."""

from experiments import _options, dlrm_kaggle


def get_config(arg=None):
  _options.parse(arg, {}, name="smoke")  # no options: an ARG would be ignored
  c = dlrm_kaggle.get_config()
  c.data.synthetic.rows = 70_000
  c.data.synthetic.scale = 0.0002
  c.model.bottom = (32, 8)
  c.model.top = (32, 1)
  c.embeddings.dim = 8
  c.train.batch_size = 256
  c.train.eval_batch_size = 4096
  c.train.steps = 40
  c.train.log_every = 10
  c.train.eval_every = 20
  c.train.checkpoint_every = 20
  return c
