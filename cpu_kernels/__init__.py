"""draftsmith's own fp32 CPU kernels: the C++ sources, the shared library built from them (`native.py`), and the
Python that calls them (the linears in `panels.py` and `packed.py`, attention in `rope_attention.py`, norms in
`layer_ops.py`, a whole layer or stack in `decoder_layer.py` and `decoder_stack.py`, staleness in `watch.py`).
Imports nothing of draftsmith but `draftsmith.files`."""
