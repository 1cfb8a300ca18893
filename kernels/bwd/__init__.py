"""The attention backward (FA3's ``hopper/flash_bwd_*``). ``pipelined.py``: a first TileLang
backward on TileLang's automatic warp specialization, the baseline; the backward issue (#46)
adds the preprocess, the explicitly warp-specialized main kernel and the postprocess here,
reusing ``kernels/fwd``'s tile schedulers, barrier enum and pipeline state."""
