"""The rollout's decode-step ops in Triton: the layer's GEMMs, residual-add + RMSNorm and SwiGLU
(``decode_layer.py``), the top-k sampler (``sampling.py``) and the step's bookkeeping
(``rollout_step.py``)."""
