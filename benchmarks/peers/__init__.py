"""The peers: the same models in other libraries, for side-by-side benchmarks (TorchRec, plain
PyTorch, PyG). They run only where `bash benchmarks/peers/install.sh` installed them (Python
3.11, CPU); each module says what is matched and `available()` / `status()` why a peer cannot
run here.

  dlrm.py           the Kaggle DLRM in TorchRec (FusedEBC) and plain PyTorch, built and timed
                    on numpy batches (dlrm_throughput.py, scaling.py, tier_scaling.py)
  dcn.py            TorchRec's DLRM_DCN on MLPerf multi-hot batches, and the check that
                    recgnn's DCNv2 computes the same (dlrm_throughput.py --model=dcnv2)
  sampling_pyg.py   PyG's NeighborLoader as a sampler contestant (sampling.py)
  install.sh        the peer stack's install recipe
"""
