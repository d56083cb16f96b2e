"""The ``prefill`` op family: a prefill chunk's top-k positions -> device rows, with its
host-only rows staged into a reserved region of the device pool.

- ``contract``: ``PrefillPlan`` and the argument rules (``check_prefill_args``), shared by
  every implementation;
- ``reference``: the pure-torch definition, bit-exact oracle of the kernels and the
  ``torch`` backend;
- ``workspace``: ``PrefillWorkspace`` (the plan, the output and the kernels' distinct-row
  table, allocated once);
- ``op``: the public ``plan_prefill`` (backend choice, eager bypass, traced path),
  ``stage_prefill`` (the plan and the gather of the staged rows) and the custom op
  ``hisparse_triton::plan_prefill`` registered at import.

The Triton kernels and their launcher live in ``hisparse_triton.kernels.prefill``; they
import the contract and the workspace, never the reference. Unlike ``resolve``, nothing here
reads or writes hot-buffer state: a prefill chunk never changes what decode steps hit.
"""
