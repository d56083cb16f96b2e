"""The ``resolve`` op family: top-k positions -> device rows, a miss plan and hot-state updates.

- ``contract``: ``ResolveResult`` and the argument rules (``check_resolve_args``), shared by
  every implementation;
- ``reference``: the pure-torch definition, bit-exact oracle of the kernel and the ``torch``
  backend;
- ``workspace``: ``ResolveWorkspace`` (reusable outputs and scratch) and
  ``restore_resolve_state`` (undo the last call made with one);
- ``op``: the public ``resolve`` (backend choice, eager bypass, traced path) and the custom
  op ``hisparse_triton::resolve`` registered at import.

The Triton kernel and its launcher live in ``hisparse_triton.kernels.resolve``; it imports the
contract and the workspace, never the reference. ``hisparse_triton.ops.resolve`` as an
attribute is the op itself; import this package's modules with the ``from`` form
(``from hisparse_triton.ops.resolve import reference``).
"""
