"""DeepSeek-V4's manifold-constrained hyper-connections (mHC) after their
projection: the pre/post/comb weights with the Sinkhorn projection and the
collapse of the streams (`mhc_pre`), the head's collapse (`mhc_head`) and the
expansion of a block's output back over the streams (`mhc_post`).
reference.py (torch) and triton.py (kernels)."""
