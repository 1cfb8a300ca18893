"""The attention backward (FA3's ``hopper/flash_bwd_*``): its home. No kernel has landed yet;
the backward issue adds the preprocess, the warp-specialized main kernel and the postprocess
here, reusing ``kernels/fwd``'s tile schedulers, barrier enum and pipeline state."""
