"""Example elastic training jobs: `python -m torch.distributed.run --nproc-per-node=2 -m workloads.examples.mlp`."""
