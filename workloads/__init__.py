"""The drop-in runtime for elastic PyTorch training scripts (filled by the elastic-jobs issue)."""
