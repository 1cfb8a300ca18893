"""The TileLang forward kernels (FA3's ``hopper/flash_fwd_*``), one family a file, and the pieces
they share: the online softmax (``softmax.py``), the tile schedulers (``tile_scheduler.py``),
the named-barrier ids (``barriers.py``) and the K/V ring's pipeline state (``pipeline.py``).
``triton_mha.py`` is the Triton forward, a peer and a ``torch.compile`` reference."""
