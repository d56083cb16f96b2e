"""The ``resolve`` op family: top-k positions -> device rows, a miss plan and hot-state updates.

Modules: ``contract`` (``ResolveResult`` and the argument rules shared by every
implementation), ``reference`` (the pure-torch definition, bit-exact oracle and CPU backend),
``workspace`` (``ResolveWorkspace``: reusable outputs and scratch; ``restore_resolve_state``).
The Triton kernel and its launcher live in ``hisparse_triton.kernels.resolve``.
"""
