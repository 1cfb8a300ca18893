"""The attention backward (FA3's ``hopper/flash_bwd_*``): ``pipelined.py`` (the main kernel on
TileLang's automatic warp specialization, and ``attention_bwd``, the op both kernels run
under), ``ws.py`` (the main kernel with explicit roles and mbarriers, the default where it
runs), ``prepost.py`` (the pre- and postprocess), ``tile_scheduler.py`` (grids and walks),
``heuristics.py`` (the dispatch rules) and ``attention_op.py`` (the trainable torch op)."""
