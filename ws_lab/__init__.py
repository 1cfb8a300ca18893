"""ws-lab: warp-specialized attention kernels for Hopper, with one harness for all of them."""
